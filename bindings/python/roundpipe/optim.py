"""Built-in optimizers: settings objects for the engine's CPU AdamW and SGD.

Pass one to :meth:`RoundPipe.step` instead of a step function::

    opt = roundpipe.optim.AdamW(lr=1e-3, weight_decay=0.01)
    for x, y in data:
        model.forward_backward((x,), label=y, loss_fn="mse")
        model.step(opt)          # runs in C++ on the optimizer thread, no Python involved
    opt.lr = 5e-4                # takes effect at the next step

They compute exactly what ``torch.optim.AdamW`` / ``torch.optim.SGD`` compute (defaults
included), on the engine's fp32 master weights. The optimizer state (moments, momentum
buffers) lives in the model, not in this object, so one settings object may serve several
models; a model refuses a step of another kind than the one that created its state.
Hyperparameters are validated by the engine when set (RoundPipeError).
"""

from . import _capi
from ._internals import Optimizer


class BuiltinOptimizer:
    """Base class: settings over an ``rp_optimizer`` (owned by ``_internals.Optimizer``:
    close() / context manager / __del__)."""

    _kind = None

    def __init__(self):
        self._settings = Optimizer(self._kind)

    @property
    def handle(self):
        """The ``rp_optimizer *`` (ctypes); ValueError once closed."""
        return self._settings.handle

    def close(self):
        self._settings.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def lr(self):
        return self._lr

    @lr.setter
    def lr(self, value):
        self._settings.set("learning_rate", float(value))
        self._lr = float(value)

    @property
    def weight_decay(self):
        return self._weight_decay

    @weight_decay.setter
    def weight_decay(self, value):
        self._settings.set("weight_decay", float(value))
        self._weight_decay = float(value)


class AdamW(BuiltinOptimizer):
    """Settings of the built-in AdamW (as ``torch.optim.AdamW``, same defaults)."""

    _kind = _capi.RP_OPTIMIZER_ADAMW

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
        super().__init__()
        self.lr = lr
        self.betas = betas
        self.eps = eps
        self.weight_decay = weight_decay

    @property
    def betas(self):
        return self._betas

    @betas.setter
    def betas(self, value):
        b1, b2 = (float(v) for v in value)
        self._settings.set("betas", b1, b2)
        self._betas = (b1, b2)

    @property
    def eps(self):
        return self._eps

    @eps.setter
    def eps(self, value):
        self._settings.set("eps", float(value))
        self._eps = float(value)

    def __repr__(self):
        return "roundpipe.optim.AdamW(lr=%g, betas=%r, eps=%g, weight_decay=%g)" % (
            self.lr, self.betas, self.eps, self.weight_decay)


class SGD(BuiltinOptimizer):
    """Settings of the built-in SGD (as ``torch.optim.SGD`` with dampening 0, no Nesterov)."""

    _kind = _capi.RP_OPTIMIZER_SGD

    def __init__(self, lr=1e-3, momentum=0.0, weight_decay=0.0):
        super().__init__()
        self.lr = lr
        self.momentum = momentum
        self.weight_decay = weight_decay

    @property
    def momentum(self):
        return self._momentum

    @momentum.setter
    def momentum(self, value):
        self._settings.set("momentum", float(value))
        self._momentum = float(value)

    def __repr__(self):
        return "roundpipe.optim.SGD(lr=%g, momentum=%g, weight_decay=%g)" % (
            self.lr, self.momentum, self.weight_decay)
