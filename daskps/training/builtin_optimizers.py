"""The optimizers Keras users expect, on the parameter servers: SGD, Adagrad, Adam, AdamW, RMSprop, Ftrl,
Adamax, Nadam and Lion.

Each class checks its arguments (messages name the argument, as Keras'
checks do) and makes the pure transform of :mod:`daskps._core.transforms`
that the servers run; :class:`~daskps.training.optimizers.Optimizer` does
the rest (clipping on the trainer, one call per server). The numbers are
Keras 3's, checked against Keras' own output in
``tests/optimizers/test_against_keras.py``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np  # noqa: F401  (the examples in the docstrings use it)

from daskps._core import transforms
from daskps.training.optimizers import (
    Optimizer,
    check_flag,
    check_optional,
    check_positive,
    check_rate,
    check_unit,
    is_number,
)

__all__ = ["Adagrad", "Adam", "AdamW", "Adamax", "Ftrl", "Lion", "Nadam", "RMSprop", "SGD"]


_COMMON = """
    Other Parameters
    ----------------
    learning_rate : float or LearningRateSchedule
        A schedule of :mod:`daskps.optimizers.schedules` is evaluated on the
        servers at each variable's step (the updates it has had so far).
    weight_decay : float, optional
        Decoupled, as Keras 3: before each step the variable is multiplied by
        ``1 - weight_decay * lr``, with that step's learning rate.
    clipnorm, clipvalue, global_clipnorm : float, optional
        Gradient clipping, on the trainer (see :class:`Optimizer`).
    lazy_sparse : bool
        Row-local updates for ``IndexedSlices`` gradients (see :class:`Optimizer`).
    name : str"""


def _rule_field(opt: KerasOptimizer, field: str) -> Any:
    return getattr(opt.transform.rule, field)


class KerasOptimizer(Optimizer):
    """What every optimizer of Keras' declares once: the learning rate, weight decay, clipping, the sparse mode
    and the name; a subclass adds only its step rule (:attr:`rule`), whose fields are its hyperparameters.

    Each hyperparameter is an attribute (``opt.beta_1``), and ``get_config()``
    / ``from_config(config)`` round-trip them, as in Keras.
    """

    rule: Any  # the step rule's class, of daskps._core.transforms (AdamStep, ...)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for field in cls.rule._fields:  # the rule's hyperparameters, read-only, as attributes
            setattr(cls, field, property(functools.partial(_rule_field, field=field),
                                         doc=f"``{field}``, as given (fixed once made)."))

    def __init__(self, rule: Any, learning_rate: Any, weight_decay: float | None, clipnorm: float | None,
                 clipvalue: float | None, global_clipnorm: float | None, lazy_sparse: bool, name: str):
        chain = transforms.Chain(rule, check_rate(learning_rate), check_optional(weight_decay, "weight_decay"))
        super().__init__(chain, lazy_sparse, name, clipnorm, clipvalue, global_clipnorm)

    @property
    def weight_decay(self) -> float | None:
        return self._transform.weight_decay

    def get_config(self) -> dict[str, Any]:
        """The arguments that make this optimizer again (``type(opt).from_config(opt.get_config())``)."""
        return {"name": self.name, "learning_rate": self._transform.learning_rate,
                **self._transform.rule._asdict(), "weight_decay": self.weight_decay, "clipnorm": self.clipnorm,
                "clipvalue": self.clipvalue, "global_clipnorm": self.global_clipnorm,
                "lazy_sparse": self.lazy_sparse}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> KerasOptimizer:
        return cls(**config)


class SGD(KerasOptimizer):
    """Gradient descent, with optional (Nesterov) momentum, as ``keras.optimizers.SGD``.

    >>> opt = SGD(0.1, momentum=0.9)
    >>> updates, state = opt.update(np.ones(2, np.float32), opt.init(np.zeros(2, np.float32)), np.zeros(2, np.float32))
    >>> updates, state.momentum
    (array([-0.1, -0.1], dtype=float32), array([-0.1, -0.1], dtype=float32))
    """

    rule = transforms.SGDStep

    def __init__(self, learning_rate: Any = 0.01, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float | None = None, clipnorm: float | None = None, clipvalue: float | None = None,
                 global_clipnorm: float | None = None, lazy_sparse: bool = True, name: str = "SGD"):
        momentum = check_positive(momentum, "momentum", allow_zero=True)
        if momentum > 1:
            raise ValueError(f"momentum must be in [0, 1], got {momentum!r}")
        rule = transforms.SGDStep(momentum, check_flag(nesterov, "nesterov"))
        super().__init__(rule, learning_rate, weight_decay, clipnorm, clipvalue, global_clipnorm, lazy_sparse, name)


class Adagrad(KerasOptimizer):
    """Adagrad, as ``keras.optimizers.Adagrad``: ``p -= lr * g / sqrt(acc + epsilon)``.

    >>> opt = Adagrad(0.1, initial_accumulator_value=0.0)
    >>> opt.update(np.ones(1, np.float32), opt.init(np.zeros(1, np.float32)), np.zeros(1, np.float32))[0]
    array([-0.1], dtype=float32)
    """

    rule = transforms.AdagradStep

    def __init__(self, learning_rate: Any = 0.001, initial_accumulator_value: float = 0.1,
                 epsilon: float = 1e-7, weight_decay: float | None = None, clipnorm: float | None = None,
                 clipvalue: float | None = None, global_clipnorm: float | None = None,
                 lazy_sparse: bool = True, name: str = "Adagrad"):
        rule = transforms.AdagradStep(check_positive(initial_accumulator_value, "initial_accumulator_value", True),
                                      check_positive(epsilon, "epsilon"))
        super().__init__(rule, learning_rate, weight_decay, clipnorm, clipvalue, global_clipnorm, lazy_sparse, name)


def _betas(beta_1: Any, beta_2: Any) -> tuple[float, float]:
    return check_unit(beta_1, "beta_1"), check_unit(beta_2, "beta_2")


class Adam(KerasOptimizer):
    """Adam, as ``keras.optimizers.Adam`` (``amsgrad`` included).

    The bias correction uses the number of updates the variable has had,
    which equals Keras' ``iterations + 1`` when every step updates it.

    >>> opt = Adam(0.1)
    >>> opt.update(np.ones(1, np.float32), opt.init(np.zeros(1, np.float32)), np.zeros(1, np.float32))[0].round(4)
    array([-0.1], dtype=float32)
    """

    rule = transforms.AdamStep

    def __init__(self, learning_rate: Any = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, amsgrad: bool = False, weight_decay: float | None = None,
                 clipnorm: float | None = None, clipvalue: float | None = None,
                 global_clipnorm: float | None = None, lazy_sparse: bool = True, name: str = "Adam"):
        rule = transforms.AdamStep(*_betas(beta_1, beta_2), check_positive(epsilon, "epsilon"),
                                   check_flag(amsgrad, "amsgrad"))
        super().__init__(rule, learning_rate, weight_decay, clipnorm, clipvalue, global_clipnorm, lazy_sparse, name)


class AdamW(Adam):
    """Adam with decoupled weight decay, as ``keras.optimizers.AdamW`` (``weight_decay`` 0.004 unless given).

    >>> opt = AdamW(0.1, weight_decay=0.5)
    >>> opt.update(np.zeros(1, np.float32), opt.init(np.ones(1, np.float32)), np.ones(1, np.float32))[0].round(4)
    array([-0.05], dtype=float32)
    """

    def __init__(self, learning_rate: Any = 0.001, weight_decay: float = 0.004, beta_1: float = 0.9,
                 beta_2: float = 0.999, epsilon: float = 1e-7, amsgrad: bool = False,
                 clipnorm: float | None = None, clipvalue: float | None = None,
                 global_clipnorm: float | None = None, lazy_sparse: bool = True, name: str = "AdamW"):
        if weight_decay is None:
            raise ValueError("weight_decay must be a non-negative number for AdamW, got None (use Adam for none)")
        super().__init__(learning_rate, beta_1, beta_2, epsilon, amsgrad, weight_decay, clipnorm, clipvalue,
                         global_clipnorm, lazy_sparse, name)


class RMSprop(KerasOptimizer):
    """RMSprop, as ``keras.optimizers.RMSprop``: steps divided by a moving root mean square of the gradients.

    ``rho`` is the moving average's decay; ``momentum > 0`` accumulates the
    steps; ``centered`` divides by an estimate of the gradients' variance
    instead (the moving mean's square subtracted).

    >>> opt = RMSprop(0.1, rho=0.0)
    >>> opt.update(np.full(1, 2.0, np.float32), opt.init(np.zeros(1, np.float32)), np.zeros(1, np.float32))[0]
    array([-0.1], dtype=float32)
    """

    rule = transforms.RMSpropStep

    def __init__(self, learning_rate: Any = 0.001, rho: float = 0.9, momentum: float = 0.0, epsilon: float = 1e-7,
                 centered: bool = False, weight_decay: float | None = None, clipnorm: float | None = None,
                 clipvalue: float | None = None, global_clipnorm: float | None = None,
                 lazy_sparse: bool = True, name: str = "RMSprop"):
        rule = transforms.RMSpropStep(check_unit(rho, "rho", high_open=False), check_positive(momentum, "momentum", True),
                                      check_positive(epsilon, "epsilon", True), check_flag(centered, "centered"))
        super().__init__(rule, learning_rate, weight_decay, clipnorm, clipvalue, global_clipnorm, lazy_sparse, name)


class Ftrl(KerasOptimizer):
    """Follow The Regularized Leader, as ``keras.optimizers.Ftrl``.

    Arguments and their checks are Keras': ``learning_rate_power <= 0``;
    the accumulator's start and the three regularisation strengths >= 0;
    ``beta`` adds ``beta / (2 * lr)`` to the L2 strength.

    >>> opt = Ftrl(0.1, l1_regularization_strength=1.0)
    >>> opt.update(np.full(1, 0.5, np.float32), opt.init(np.zeros(1, np.float32)), np.zeros(1, np.float32))[0]
    array([0.], dtype=float32)
    """

    rule = transforms.FtrlStep

    def __init__(self, learning_rate: Any = 0.001, learning_rate_power: float = -0.5,
                 initial_accumulator_value: float = 0.1, l1_regularization_strength: float = 0.0,
                 l2_regularization_strength: float = 0.0, l2_shrinkage_regularization_strength: float = 0.0,
                 beta: float = 0.0, weight_decay: float | None = None, clipnorm: float | None = None,
                 clipvalue: float | None = None, global_clipnorm: float | None = None,
                 lazy_sparse: bool = True, name: str = "Ftrl"):
        if not is_number(learning_rate_power) or learning_rate_power > 0:
            raise ValueError(f"learning_rate_power must be a number <= 0, got {learning_rate_power!r}")
        rule = transforms.FtrlStep(
            float(learning_rate_power),
            check_positive(initial_accumulator_value, "initial_accumulator_value", True),
            check_positive(l1_regularization_strength, "l1_regularization_strength", True),
            check_positive(l2_regularization_strength, "l2_regularization_strength", True),
            check_positive(l2_shrinkage_regularization_strength, "l2_shrinkage_regularization_strength", True),
            check_positive(beta, "beta", True))
        super().__init__(rule, learning_rate, weight_decay, clipnorm, clipvalue, global_clipnorm, lazy_sparse, name)


class Adamax(KerasOptimizer):
    """Adamax, as ``keras.optimizers.Adamax``: Adam with an infinity norm of the gradients in place of ``v``.

    >>> opt = Adamax(0.1)
    >>> opt.update(np.ones(1, np.float32), opt.init(np.zeros(1, np.float32)), np.zeros(1, np.float32))[0].round(4)
    array([-0.1], dtype=float32)
    """

    rule = transforms.AdamaxStep

    def __init__(self, learning_rate: Any = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, weight_decay: float | None = None, clipnorm: float | None = None,
                 clipvalue: float | None = None, global_clipnorm: float | None = None,
                 lazy_sparse: bool = True, name: str = "Adamax"):
        rule = transforms.AdamaxStep(*_betas(beta_1, beta_2), check_positive(epsilon, "epsilon"))
        super().__init__(rule, learning_rate, weight_decay, clipnorm, clipvalue, global_clipnorm, lazy_sparse, name)


class Nadam(KerasOptimizer):
    """Nadam (Adam with Nesterov momentum), as ``keras.optimizers.Nadam``.

    Keras keeps a running product of momentum-decay terms (``u_product``),
    multiplied once per step. Here it is computed from each variable's (or
    shard's) own step count, which lives in its state on its server, so
    sharding, checkpoints and re-created servers need nothing more; it is
    Keras' product when every step updates every variable.

    >>> opt = Nadam(0.1)
    >>> updates, state = opt.update(np.ones(1, np.float32), opt.init(np.zeros(1, np.float32)), np.zeros(1, np.float32))
    >>> state.count, bool(updates[0] < 0)
    (1, True)
    """

    rule = transforms.NadamStep

    def __init__(self, learning_rate: Any = 0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, weight_decay: float | None = None, clipnorm: float | None = None,
                 clipvalue: float | None = None, global_clipnorm: float | None = None,
                 lazy_sparse: bool = True, name: str = "Nadam"):
        rule = transforms.NadamStep(*_betas(beta_1, beta_2), check_positive(epsilon, "epsilon"))
        super().__init__(rule, learning_rate, weight_decay, clipnorm, clipvalue, global_clipnorm, lazy_sparse, name)


class Lion(KerasOptimizer):
    """Lion, as ``keras.optimizers.Lion``: steps of size ``learning_rate`` along the sign of a momentum mix.

    As Keras, ``beta_1`` must be in (0, 1] (at 0 it would be sign descent).

    >>> opt = Lion(0.1)
    >>> opt.update(np.full(1, -3.0, np.float32), opt.init(np.zeros(1, np.float32)), np.zeros(1, np.float32))[0]
    array([0.1], dtype=float32)
    """

    rule = transforms.LionStep

    def __init__(self, learning_rate: Any = 0.001, beta_1: float = 0.9, beta_2: float = 0.99,
                 weight_decay: float | None = None, clipnorm: float | None = None, clipvalue: float | None = None,
                 global_clipnorm: float | None = None, lazy_sparse: bool = True, name: str = "Lion"):
        rule = transforms.LionStep(check_unit(beta_1, "beta_1", low_open=True, high_open=False),
                                   check_unit(beta_2, "beta_2", high_open=False))
        super().__init__(rule, learning_rate, weight_decay, clipnorm, clipvalue, global_clipnorm, lazy_sparse, name)


# The arguments every optimizer shares are described once, and shown by help() on each.
for _cls in (SGD, Adagrad, Adam, AdamW, RMSprop, Ftrl, Adamax, Nadam, Lion):
    _cls.__doc__ = (_cls.__doc__ or "").rstrip() + "\n" + _COMMON + "\n    "
