"""A compiled Keras optimizer as the daskps optimizer that runs its maths on the parameter servers.

Only Keras' own classes are taken, by exact class: a subclass may override
``update_step`` and so change the maths, which the servers would not see.
The learning rate (a number or one of Keras' schedules), weight decay and
clipping carry over from ``get_config()``; Keras options that the servers do
not implement (an exponential moving average of the weights, loss scaling,
gradient accumulation) are refused by name rather than dropped.
"""

from __future__ import annotations

from typing import Any

from daskps._core import schedules
from daskps.training import builtin_optimizers
from daskps.training.optimizers import Optimizer

__all__ = ["from_keras", "keras_config", "schedule_from_keras", "uses_schedule"]

# Keras options daskps' optimizers do not have, and the value that means "off".
_UNSUPPORTED = {"use_ema": False, "loss_scale_factor": None, "gradient_accumulation_steps": None}
_IGNORED = {"ema_momentum", "ema_overwrite_frequency"}  # meaningful only with use_ema


def _keras_class(obj: Any, module: Any, names: list[str], what: str) -> str:
    """The name of ``obj``'s class if it is exactly one of ``module``'s ``names``, else a TypeError."""
    cls, name = type(obj), type(obj).__name__
    keras_cls = getattr(module, name, None) if name in names else None
    # Keras' own class, or the backend's version of it that Keras itself makes (torch's fused Adam, ...)
    if keras_cls is not None and (cls is keras_cls or (cls.__module__.startswith("keras.src.backend.")
                                                       and issubclass(cls, keras_cls))):
        return name
    raise TypeError(
        f"{what} of class {type(obj).__module__}.{type(obj).__qualname__} cannot run on the parameter servers: "
        f"dps.keras takes Keras' own {', '.join(names)} (exactly those classes: a subclass may change the "
        "maths, which the servers would not run)"
    )


def schedule_from_keras(schedule: Any) -> schedules.LearningRateSchedule:
    """A Keras learning-rate schedule (an object or its serialized dict) as daskps' schedule of the same class."""
    import keras

    if isinstance(schedule, dict):
        schedule = keras.optimizers.schedules.deserialize(schedule)
    names = [n for n in dir(schedules) if isinstance(getattr(schedules, n), type)
             and issubclass(getattr(schedules, n), schedules.LearningRateSchedule)
             and n != "LearningRateSchedule" and hasattr(keras.optimizers.schedules, n)]
    name = _keras_class(schedule, keras.optimizers.schedules, sorted(names), "a learning-rate schedule")
    return getattr(schedules, name)(**schedule.get_config())


def uses_schedule(optimizer: Any) -> bool:
    """Whether a Keras optimizer's learning rate is a schedule (its value then follows ``iterations``)."""
    return isinstance(optimizer.get_config().get("learning_rate"), dict)


def keras_config(optimizer: Any) -> tuple[type[Optimizer], dict[str, Any]]:
    """The daskps class and arguments that do what the Keras ``optimizer`` does; nothing is made.

    Raises
    ------
    TypeError
        ``optimizer`` is not exactly one of Keras' SGD, Adagrad, Adam, AdamW,
        RMSprop, Ftrl, Adamax, Nadam or Lion, or its schedule is not one of
        Keras' own.
    ValueError
        A Keras option the servers do not implement (``use_ema``,
        ``loss_scale_factor``, ``gradient_accumulation_steps``).
    """
    import keras

    cls_name = _keras_class(optimizer, keras.optimizers, sorted(builtin_optimizers.__all__), "the optimizer")
    try:  # set only once exclude_from_weight_decay is called
        excluded = optimizer._exclude_from_weight_decay or optimizer._exclude_from_weight_decay_pattern
    except AttributeError:
        excluded = None
    if excluded:
        raise ValueError("the model's optimizer excludes variables from weight decay (exclude_from_weight_decay), "
                         "which dps.keras does not carry to the servers yet; compile without it, or with "
                         "weight_decay=None")
    config = dict(optimizer.get_config())
    for option, off in _UNSUPPORTED.items():
        value = config.pop(option, off)
        if value != off:
            raise ValueError(
                f"the model's optimizer has {option}={value!r}, which dps.keras does not run on the parameter "
                f"servers; compile the model with {option}={off!r}"
            )
    for option in _IGNORED:
        config.pop(option, None)
    config["name"] = config.get("name") or cls_name
    if isinstance(config.get("learning_rate"), dict):
        config["learning_rate"] = schedule_from_keras(config["learning_rate"])
    else:
        config["learning_rate"] = float(config["learning_rate"])
    # Keras turns a sparse gradient dense and updates every row: the same maths here.
    config["lazy_sparse"] = False
    return getattr(builtin_optimizers, cls_name), config


def from_keras(optimizer: Any) -> Optimizer:
    """Make, in the current ``strategy.scope()``, the daskps optimizer that does what ``optimizer`` does.

    >>> import os; os.environ.setdefault("KERAS_BACKEND", "jax")  # doctest: +SKIP
    >>> import keras, daskps as dps                                 # doctest: +SKIP
    >>> dps.keras.optimizer.from_keras(keras.optimizers.Adam(0.01))  # doctest: +SKIP
    <daskps.optimizers.Adam 'adam' learning_rate=0.009999999776482582>
    """
    cls, config = keras_config(optimizer)
    return cls(**config)
