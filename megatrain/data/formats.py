"""Records -> token ids with the tokens trained on: plain text, prompt / completion, alpaca, sharegpt and messages.

Text trains on every token (an end-of-text token closes each document). Chat formats are rendered with the
tokenizer's own chat template and train on what the assistant says (its reply and the end-of-turn token the
template closes it with), nothing else: the prompt of each turn is the conversation so far rendered with the
template's generation prompt, the reply is what rendering the turn adds to it; the whole conversation is tokenized
once and each token is trained on where its characters lie in a reply. A template that renders a reply otherwise
when it ends the conversation (Qwen3's reasoning block) has each reply trained on as the whole conversation renders
it: from its prompt to its end-of-turn token, the reply's text found there as written. A template whose prompts are
not each a prefix of the conversation is refused. Alpaca is one turn:
the instruction (and its input) as the user's message, the output as the reply; without a chat template, in the
alpaca prompt format with the loss on the response and the end-of-text token. Prompt / completion (TRL's
format): as strings, the prompt's tokens then the completion's and the end-of-text token, trained on the completion
and that token; as lists of messages, the conversation they make rendered with the chat template, trained on the
completion's assistant turns only (not on any assistant turn the prompt holds). Messages may carry an assistant's
``tool_calls`` (its content then empty) and tool results, and a record its ``tools``' definitions, all rendered by
the template; the tool calls are trained on as replies are.
"""

from __future__ import annotations

import json
import sys
import weakref
from dataclasses import dataclass

import numpy as np

from megatrain.data.errors import DataError

FORMATS = ("text", "prompt_completion", "alpaca", "sharegpt", "messages")
# the fields each format reads (a column mapping may name others)
FIELDS = {"text": ("text",), "prompt_completion": ("prompt", "completion", "tools"),
          "alpaca": ("instruction", "input", "output", "system"), "sharegpt": ("conversations", "tools"),
          "messages": ("messages", "tools")}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system",
                  "function_call": "assistant", "observation": "tool"}  # (the last two: tool use, as LLaMA-Factory
# writes it: a call's value is the JSON of {"name", "arguments"}, an observation's the tool's result)
ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n{input}### Response:\n"


@dataclass
class Example:
    ids: list[int]
    train: list[bool]  # per token: trained on (predicted from the tokens before it)


@dataclass
class Documents:
    """Tokenized documents one after the other in flat arrays (no Python object per token)."""

    ids: np.ndarray  # (tokens,) int32
    train: np.ndarray  # (tokens,) bool
    lengths: np.ndarray  # (documents,) int64

    @classmethod
    def of(cls, examples: list[Example]) -> "Documents":
        lengths = np.array([len(e.ids) for e in examples], dtype=np.int64)
        if not len(examples):
            return cls(np.zeros(0, np.int32), np.zeros(0, bool), lengths)
        return cls(np.concatenate([np.asarray(e.ids, np.int32) for e in examples]),
                   np.concatenate([np.asarray(e.train, bool) for e in examples]), lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    def select(self, docs: np.ndarray) -> "Documents":
        """The documents at indices ``docs`` (in that order)."""
        starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]])
        lengths = self.lengths[docs]
        idx = np.repeat(starts[docs] - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths) + \
            np.arange(int(lengths.sum()))
        return Documents(self.ids[idx], self.train[idx], lengths)


def detect(record: dict, columns: dict[str, str]) -> str:
    """The format of ``record`` from the fields it has."""
    has = lambda f: columns.get(f, f) in record  # noqa: E731
    if has("messages"):
        return "messages"
    if has("conversations"):
        return "sharegpt"
    if has("instruction") and has("output"):
        return "alpaca"
    if has("prompt") and has("completion"):
        return "prompt_completion"
    if has("text"):
        return "text"
    raise DataError(f"a record with fields {sorted(record)} is none of the formats: text ('text'), prompt_completion "
                    f"('prompt', 'completion'), alpaca ('instruction', 'output'), sharegpt ('conversations'), "
                    f"messages ('messages'); name the fields with --columns, e.g. text=body")


def to_example(record: dict, fmt: str, tok, columns: dict[str, str]) -> Example:
    """``record`` in format ``fmt`` as token ids and the tokens trained on; DataError naming the problem."""
    get = lambda f: record.get(columns.get(f, f))  # noqa: E731
    if fmt == "text":
        text = get("text")
        if not isinstance(text, str):
            raise DataError(f"field {columns.get('text', 'text')!r} must be a string, got {text!r}"[:200])
        ids = tok(text, add_special_tokens=True)["input_ids"]
        if not ids or ids[-1] != tok.eos_token_id:
            ids = ids + [tok.eos_token_id]
        return Example(ids, [True] * len(ids))
    if fmt == "prompt_completion":
        prompt, completion = get("prompt"), get("completion")
        if isinstance(prompt, str) and isinstance(completion, str):
            head = tok(prompt, add_special_tokens=True)["input_ids"]
            reply = tok(completion, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            return Example(head + reply, [False] * len(head) + [True] * len(reply))
        if _messages(prompt) and _messages(completion):
            return chat_example(_clean(prompt) + _clean(completion), tok, trained_from=len(prompt),
                                tools=_tools(get("tools"), columns))
        raise DataError(f"fields {columns.get('prompt', 'prompt')!r} and {columns.get('completion', 'completion')!r} "
                        f"must both be strings or both lists of {{'role': ..., 'content': text}}, got "
                        f"{type(prompt).__name__} and {type(completion).__name__}")
    if fmt == "alpaca":
        instruction, inp, output, system = (get(f) for f in FIELDS["alpaca"])
        for name, v in (("instruction", instruction), ("output", output)):
            if not isinstance(v, str):
                raise DataError(f"field {columns.get(name, name)!r} must be a string, got {v!r}"[:200])
        inp = inp if isinstance(inp, str) else ""
        if tok.chat_template:
            messages = ([{"role": "system", "content": system}] if isinstance(system, str) and system else [])
            messages += [{"role": "user", "content": instruction + (f"\n\n{inp}" if inp else "")},
                         {"role": "assistant", "content": output}]
            return chat_example(messages, tok)
        prompt = ALPACA_PROMPT.format(instruction=instruction, input=f"### Input:\n{inp}\n\n" if inp else "")
        head = tok(prompt, add_special_tokens=True)["input_ids"]
        reply = tok(output, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return Example(head + reply, [False] * len(head) + [True] * len(reply))
    if fmt == "sharegpt":
        turns = get("conversations")
        if not isinstance(turns, list):
            raise DataError(f"field {columns.get('conversations', 'conversations')!r} must be a list of turns")
        messages = []
        for i, t in enumerate(turns):
            if not isinstance(t, dict) or not isinstance(t.get("value"), str) or t.get("from") not in SHAREGPT_ROLES:
                raise DataError(f"conversations[{i}] must be {{'from': one of {sorted(SHAREGPT_ROLES)}, 'value': "
                                f"text}}, got {t!r}"[:300])
            if t["from"] == "function_call":
                messages.append({"role": "assistant", "tool_calls": [{"type": "function",
                                                                      "function": _call(t["value"], i)}]})
            else:
                messages.append({"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]})
        return chat_example(messages, tok, tools=_tools(get("tools"), columns))
    if fmt == "messages":
        messages = get("messages")
        if not _messages(messages):
            raise DataError(f"field {columns.get('messages', 'messages')!r} must be a list of "
                            f"{{'role': ..., 'content': text}} (an assistant's content may be empty where it has "
                            f"'tool_calls')")
        return chat_example(_clean(messages), tok, tools=_tools(get("tools"), columns))
    raise DataError(f"unknown data format {fmt!r}; formats: {', '.join(FORMATS)}")


def _messages(value) -> bool:
    """Whether ``value`` is a list of ``{'role': str, 'content': str}`` messages (an assistant's content may be
    missing or None where it has a list of ``tool_calls``; other keys, as a tool message's name, go to the
    template)."""
    def one(m) -> bool:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return False
        return isinstance(m.get("content"), str) or (
            m.get("content") is None and m["role"] == "assistant" and isinstance(m.get("tool_calls"), list)
            and len(m["tool_calls"]) > 0)

    return isinstance(value, list) and all(one(m) for m in value)


def _call(value: str, i: int) -> dict:
    """A ShareGPT ``function_call`` turn's value as the ``function`` of a tool call: ``{"name", "arguments"}``."""
    try:
        call = json.loads(value)
    except json.JSONDecodeError as e:
        raise DataError(f"conversations[{i}]: a function_call's value must be the JSON of {{'name', 'arguments'}} "
                        f"({e.msg} at {e.pos})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        raise DataError(f"conversations[{i}]: a function_call's value must be the JSON of {{'name', 'arguments'}}, "
                        f"got {value!r}"[:300])
    return {"name": call["name"], "arguments": call["arguments"]}


def _clean(messages: list[dict]) -> list[dict]:
    """The messages without the keys a columnar file gives every message of a column (None where a message has
    none: a user message's ``tool_calls``), as the template would see them written by hand."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def _tools(value, columns: dict[str, str]):
    """A record's tool definitions for the chat template: a list of JSON schemas, or that list as a JSON string (as
    data sets store them to keep one column type); None where the record has none."""
    if value is None:
        return None
    name = columns.get("tools", "tools")
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(f"field {name!r} is a string but not JSON ({e.msg} at {e.pos})") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DataError(f"field {name!r} must be a list of tool definitions (JSON objects), got {value!r}"[:300])
    return value or None


def _reply_end(full: str, start: int, content: str, eot: str | None) -> int | None:
    """Where a reply that begins at ``start`` of the rendered conversation ``full`` ends (after its end-of-turn
    token ``eot``), for a template that renders a turn otherwise when it is the conversation's last (Qwen3's adds
    an empty reasoning block to the replies after the last user message, so a reply rendered last is not a prefix
    of the conversation): its ``content`` as written, within its turn (before the next end-of-turn token), then
    that token after nothing but white space. None where the reply cannot be found so."""
    if not eot or not content:
        return None
    stop = full.find(eot, start)
    at = full.find(content, start)
    if stop < 0 or at < 0 or at + len(content) > stop or full[at + len(content):stop].strip():
        return None
    return stop + len(eot)


def chat_example(messages: list[dict], tok, trained_from: int = 0, tools: list[dict] | None = None) -> Example:
    """A conversation rendered with ``tok``'s chat template (and its ``tools``' definitions), trained on the
    assistant's replies (see the module doc), tool calls included, from message ``trained_from`` on (those before
    it are prompt, whatever their role)."""
    if not tok.chat_template:
        raise DataError("chat data needs a tokenizer with a chat template, and this one has none")
    if not any(m["role"] == "assistant" for m in messages[trained_from:]):
        raise DataError("a conversation without an assistant turn has nothing to train on" if not trained_from else
                        "a completion without an assistant turn has nothing to train on")
    def render(ms, prompt=False):
        return tok.apply_chat_template(ms, tools=tools, tokenize=False, add_generation_prompt=prompt)

    full = render(messages)
    _warn_dropped(tok, messages, full)
    refused = DataError("the chat template does not render a conversation as each turn's prompt followed by its "
                        "reply (the rendering of a turn is not a prefix of the next), so the assistant's tokens "
                        "cannot be told apart")
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < trained_from:
            continue
        prompt, upto = render(messages[:i], True) if i else "", render(messages[: i + 1])
        if not full.startswith(prompt):
            raise refused
        if full.startswith(upto) and upto.startswith(prompt):
            end = len(upto)
            eot = upto.rfind(tok.eos_token, len(prompt)) if tok.eos_token else -1
            if eot >= 0:  # the reply ends with its end-of-turn token; what the template adds after it is not trained
                end = eot + len(tok.eos_token)
        else:
            end = _reply_end(full, len(prompt), m.get("content"), tok.eos_token)
            if end is None:
                raise refused
        spans.append((len(prompt), end))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    train = [any(a <= lo < b for a, b in spans) for lo, _ in enc["offset_mapping"]]
    return Example(list(enc["input_ids"]), train)


_SAID: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> what it was warned of


def _warn_dropped(tok, messages: list[dict], full: str) -> None:
    """One warning line per tokenizer and kind where its chat template leaves out of ``full`` (a conversation's
    rendering) a tool call an assistant turn makes (its function's name absent: a template without tool support),
    or a turn's text (as Qwen3's drops the reasoning of earlier replies): such turns train as the template renders
    them."""
    said = _SAID.setdefault(tok, set())
    for m in messages:
        names = [(c.get("function") or {}).get("name") for c in m.get("tool_calls") or [] if isinstance(c, dict)]
        name = next((n for n in names if isinstance(n, str) and n and n not in full), None)
        if name is not None and "tool calls" not in said:
            said.add("tool calls")
            print(f"megatrain train: warning: the chat template leaves out the tool calls of assistant turns (the "
                  f"call of {name!r} is not in the rendering): those turns train without them; a template with tool "
                  f"support keeps them (--chat-template FILE)", file=sys.stderr, flush=True)
        text = m.get("content")
        if isinstance(text, str) and text.strip() and text.strip() not in full and "text" not in said:
            said.add("text")
            print(f"megatrain train: warning: the chat template leaves out part of the text of a turn ({m.get('role')}"
                  f": {text.strip()[:40]!r}): such turns train as the template renders them", file=sys.stderr,
                  flush=True)
