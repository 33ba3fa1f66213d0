"""The schedule IR and the layer graph it is made for: pure data, no torch.

A :class:`Schedule` is a program-ordered tuple of :class:`Op`. Each op runs on one :class:`Stream`; ops of one stream
run in program order; ``deps`` name earlier ops (by id) of any stream that must finish first. An op's ``slots`` name
the device buffers it touches, each with a role:

======  =============================================================================
role    meaning
======  =============================================================================
``w``   weight slot holding the layer's weights (read)
``g``   gradient slot the layer accumulates its fp32 gradient into (read + write)
``x``   activation slot holding the layer's input checkpoint; BWD/LOSS overwrite it in
        place with the gradient of that input
``y``   activation slot FWD (or REFWD) writes the layer's output into
``dy``  activation slot holding the gradient of the layer's output (read)
``a``   activation slot a SAVE_ACT reads or a LOAD_ACT writes
``o``   optimizer slot holding a device-updated layer's master weights, moments and gradient
``k``   kept-gradient slot: a NORM copies a complete gradient there (in the host buffers' dtype) from its
        gradient slot, which is then free; the layer's STORE_G in the update pass reads it
``h``   host gradient buffer (pinned host memory): a STORE_G to the host writes the layer's gradient into it,
        the layer's host OPT reads it
======  =============================================================================

Text form of one op (one line, parsed back by :meth:`Op.from_str`)::

    12 BWD s0 L3 m1 @compute w1 x4 dy7 g0 <- 9,11

Modules: :mod:`~megatrain.ir.op` (an op and its text form), :mod:`~megatrain.ir.schedule` (the schedule and its
config), :mod:`~megatrain.ir.contents` (what ops read and write in their slots, queues), :mod:`~megatrain.ir.graph`
(the layer graph), :mod:`~megatrain.ir.slots` (what each slot holds), :mod:`~megatrain.ir.timeline` (when ops
ran, simulated or measured).
"""

from megatrain.ir.contents import (OUTLIVING_POOLS, QUEUES, Carried, Queue, contents_of, deferrable_opts,
                                   initial_contents, issue_preds, op_contents, queue_of, resident_slots, setup_ops,
                                   slot_contents, split_part)
from megatrain.ir.graph import Layer, LayerGraph
from megatrain.ir.op import (FORMAT_VERSION, FORWARDS, KIND_STREAMS, ROLES, SLOT_POOL, STREAM_ORDER, IRError, Op,
                             OpKind, Stream)
from megatrain.ir.schedule import QUIET_DEFAULTS, TUPLE_KEYS, Schedule, ScheduleConfig, format_table
from megatrain.ir.slots import HOST_POOLS, POOLS, op_params, slot_params
from megatrain.ir.timeline import Timeline

__all__ = ["Carried", "contents_of", "deferrable_opts", "format_table", "FORMAT_VERSION", "FORWARDS", "HOST_POOLS",
           "initial_contents", "IRError", "issue_preds", "KIND_STREAMS", "Layer", "LayerGraph", "Op", "op_contents",
           "op_params", "OpKind", "OUTLIVING_POOLS", "POOLS", "Queue", "queue_of", "QUEUES", "QUIET_DEFAULTS",
           "resident_slots", "ROLES", "Schedule", "ScheduleConfig", "setup_ops", "slot_contents", "slot_params",
           "SLOT_POOL", "split_part", "Stream", "STREAM_ORDER", "Timeline", "TUPLE_KEYS"]
