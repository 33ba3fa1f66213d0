"""A run directory that one run owns, files in it written whole or not at all, and signals that stop a run
between steps."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import threading
from pathlib import Path

LOCK = ".lock"
RUN_FILE = "run.json"  # the run's config and the identity of its data, written first
PLAN_FILE = "plan.json"  # the plan the run took (planner.run_plan.RunPlan.to_json): a resume takes it, unsearched
STATE_DIR = "state"  # the training state (megatrain.runtime.state.train_state), at the end and every save_every steps


class RunDirectory:
    """``out``, made if needed, empty, and locked for this process (an exclusive ``flock`` on ``out/.lock``, held
    until :meth:`close`): a second run into the same directory is refused in one line, even when both start at
    once. :meth:`abandon` removes what was made, for a run that could not start."""

    def __init__(self, out: str | Path):
        self.path = Path(out)
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"output path {self.path} exists and is not a directory; choose another --out")
        self.created = not self.path.exists()
        self.fd = None
        if not self.created and any(p.name != LOCK for p in self.path.iterdir()):
            self._refuse_taken()  # the files of another run: left as they are
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"output directory {self.path} cannot be created ({e.strerror})") from None
        fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            self._refuse_taken()
        self.fd = fd
        if any(p.name != LOCK for p in self.path.iterdir()):  # another run wrote here before it was ours
            self.close()
            self._refuse_taken()
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)

    def _refuse_taken(self):
        """One line: the directory is another run's, in use now (its lock held) or finished (not empty)."""
        who = holder(self.path)
        if who is not None:
            raise ValueError(f"output directory {self.path} is in use by another megatrain train"
                             + (f" (process {who})" if who else "") + "; choose another --out")
        raise ValueError(f"output directory {self.path} is not empty; choose another --out")

    def close(self) -> None:
        """Release the lock (the directory stays)."""
        if self.fd is not None:
            (self.path / LOCK).unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None

    def discard(self) -> None:
        """Remove what this run wrote (the directory was empty when the run took it), and the directory if the run
        made it: for a run stopped before its first step."""
        for p in self.path.iterdir():
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            elif p.name != LOCK:
                p.unlink(missing_ok=True)
        self.abandon()

    def abandon(self) -> None:
        """Release the lock and remove the directory if this run made it and wrote nothing into it."""
        self.close()
        if self.created:
            try:
                self.path.rmdir()
            except OSError:
                pass


def holder(run: str | Path) -> str | None:
    """Where a run is training into the directory ``run`` now (its lock held): the process id it wrote ("" where
    none can be read); None where no run holds it."""
    lock = Path(run) / LOCK
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return os.pread(fd, 32, 0).decode(errors="replace").strip()
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


# what whole-file writes leave when their process dies: ".NAME.tmp-PID" files and ".tokenizer-PID" directories
LEFTOVER = re.compile(r"^\.(.+\.tmp|tokenizer)-(\d+)$")


def remove_leftovers(d: str | Path) -> list[Path]:
    """Remove from ``d`` the temporary files and directories that writes of processes no longer alive left there
    (an export or a summary killed mid-write); returns them."""
    from megatrain.runtime.state.state_dirs import pid_alive

    gone = []
    d = Path(d)
    for x in sorted(d.iterdir()) if d.is_dir() else []:
        m = LEFTOVER.match(x.name)
        if m and not pid_alive(int(m.group(2))):
            if x.is_dir() and not x.is_symlink():
                shutil.rmtree(x, ignore_errors=True)
            else:
                x.unlink(missing_ok=True)
            gone.append(x)
    return gone


def flush_to_disk(f) -> None:
    """``f``'s bytes on the disk (flushed, synced), and its pages dropped from the page cache: a file of many GB
    written while the store fills most of the host leaves no cache that the kernel must reclaim under pressure."""
    f.flush()
    os.fsync(f.fileno())
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def write_whole(path: str | Path, data: bytes | str) -> None:
    """Write ``path`` through a temporary file renamed over it: a full disk or a crash leaves the old file (or
    none), never a cut one; an error is an OSError naming the file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            flush_to_disk(f)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, f"{path} could not be written ({e.strerror or e})") from None


def save_whole(path: str | Path, save) -> None:
    """``save(tmp_path)`` (a library's writer), then the file renamed into place; as :func:`write_whole`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save(str(tmp))
        os.replace(tmp, path)
    except Exception as e:  # noqa: BLE001 - writers of other libraries raise their own types for a full disk
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise OSError(e.errno, f"{path} could not be written ({e.strerror or e})") from None
        raise OSError(f"{path} could not be written ({e})") from None


EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


_exit = os._exit  # (tests replace it)


def stop_at_once(signum, frame, undo=None, words: str = "") -> None:
    """A signal handler for moments when nothing is in flight to finish: ``undo()`` (a run's: what it wrote before
    its first step), one line, and the process ends with 130 (SIGINT) or 143 (SIGTERM). It exits rather than
    raising: a signal can arrive while C++ code (torch's import, a tokenizer) runs Python, where an exception would
    abort the process instead."""
    import sys

    if undo is not None:
        try:
            undo()
        except OSError:
            pass
    print(f"megatrain: stopped by {signal.Signals(signum).name}{words}", file=sys.stderr, flush=True)
    _exit(EXIT_CODES[signal.Signals(signum)])


def answering_signals(fn, *args):
    """``fn(*args)`` on a thread of its own while this one waits in steps of 0.1 s, so that a signal is answered
    at once even while ``fn`` sits in a long native call (a tokenizer's training: 2 s and more, during which the
    main thread runs no signal handler); its result, or its exception."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return fn(*args)
    out: list = []

    def work():
        try:
            out.append((True, fn(*args)))
        except BaseException as e:  # noqa: BLE001 - handed to the caller as it is
            out.append((False, e))

    t = threading.Thread(target=work, name="megatrain-prepare", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.1)
    ok, value = out[0]
    if not ok:
        raise value
    return value


class StopSignals:
    """While entered: SIGINT and SIGTERM stop the process at once (:func:`stop_at_once`, after ``discard()``: what
    the run wrote so far) until :meth:`begin_steps`; from then on they ask the run to stop after the step in flight
    (``requested`` names the signal), and a second one of either stops at once (KeyboardInterrupt). Outside the main
    thread it does nothing."""

    EXIT_CODES = EXIT_CODES

    def __init__(self, discard=None):
        self.requested: signal.Signals | None = None
        self.stepping = False
        self.discard = discard
        self._before: dict = {}

    def begin_steps(self) -> None:
        """From here a signal lets the step in flight finish and the run save what it has."""
        self.stepping = True

    def _handle(self, signum, frame) -> None:
        if not self.stepping:
            stop_at_once(signum, frame, self.discard, " before the first step; nothing was trained or saved")
            return
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in self.EXIT_CODES:
                self._before[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._before.items():
            signal.signal(s, h)
        self._before = {}

    @property
    def exit_code(self) -> int:
        return self.EXIT_CODES[self.requested] if self.requested is not None else 0
