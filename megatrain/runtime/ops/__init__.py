"""What each op of a schedule does: one handler per (op kind, stream), used by both issuers. :mod:`.compute` holds
the handlers of inputs, weights, activations and the layers' forward, loss and backward; :mod:`.update` those of
gradients, their norms, the step's guard and the updates with their state's loads and stores."""

from megatrain.ir import OpKind, Stream
from megatrain.runtime.ops.compute import (bwd, eval_loss, fwd, keep_w, load_act, load_in, load_w, load_w_kept, loss,
                                           loss_out, refwd, save_act)
from megatrain.runtime.ops.update import (check, guard, load_opt, norm, opt_on_device, opt_on_host, store_g_to_host,
                                          store_g_to_slot, store_opt)

HANDLERS = {
    (OpKind.LOAD_IN, Stream.H2D): load_in,
    (OpKind.LOAD_W, Stream.H2D): load_w,
    (OpKind.LOAD_W, Stream.COMPUTE): load_w_kept,
    (OpKind.KEEP_W, Stream.H2D): keep_w,
    (OpKind.FWD, Stream.COMPUTE): fwd,
    (OpKind.REFWD, Stream.COMPUTE): refwd,
    (OpKind.LOSS, Stream.COMPUTE): loss,
    (OpKind.EVAL, Stream.COMPUTE): eval_loss,
    (OpKind.BWD, Stream.COMPUTE): bwd,
    (OpKind.SAVE_ACT, Stream.D2H): save_act,
    (OpKind.LOAD_ACT, Stream.H2D): load_act,
    (OpKind.STORE_G, Stream.D2H): store_g_to_host,
    (OpKind.STORE_G, Stream.COMPUTE): store_g_to_slot,
    (OpKind.NORM, Stream.COMPUTE): norm,
    (OpKind.OPT, Stream.CPU): opt_on_host,
    (OpKind.OPT, Stream.COMPUTE): opt_on_device,
    (OpKind.LOAD_OPT, Stream.H2D): load_opt,
    (OpKind.STORE_OPT, Stream.D2H): store_opt,
    (OpKind.GUARD, Stream.COMPUTE): guard,
    (OpKind.CHECK, Stream.CPU): check,
    (OpKind.LOSS_OUT, Stream.D2H): loss_out,
}
