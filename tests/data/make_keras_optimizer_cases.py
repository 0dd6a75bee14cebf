"""Regenerate tests/data/keras_optimizer_cases.json with Keras itself.

    python tests/data/make_keras_optimizer_cases.py > tests/data/keras_optimizer_cases.json

Five dense steps of SGD, Adagrad and Adam (several settings) on a 3x2
float32 variable with fixed gradients; the variable after each step.
"""

import json

import keras
import numpy as np

CONFIGS = [
    ("SGD", {"learning_rate": 0.1}),
    ("SGD", {"learning_rate": 0.1, "momentum": 0.9}),
    ("SGD", {"learning_rate": 0.05, "momentum": 0.5, "nesterov": True}),
    ("Adagrad", {"learning_rate": 0.1}),
    ("Adagrad", {"learning_rate": 0.2, "initial_accumulator_value": 0.5, "epsilon": 1e-3}),
    ("Adam", {"learning_rate": 0.01}),
    ("Adam", {"learning_rate": 0.1, "beta_1": 0.5, "beta_2": 0.9, "epsilon": 1e-4}),
    ("Adam", {"learning_rate": 0.05, "amsgrad": True}),
]


def main():
    rng = np.random.default_rng(0)
    start = rng.normal(size=(3, 2)).astype(np.float32)
    grads = rng.normal(size=(5, 3, 2)).astype(np.float32)
    cases = []
    for name, kwargs in CONFIGS:
        var = keras.Variable(start)
        opt = getattr(keras.optimizers, name)(**kwargs)
        steps = []
        for g in grads:
            opt.apply_gradients([(g, var)])
            steps.append(np.asarray(var).tolist())
        cases.append({"optimizer": name, "kwargs": kwargs, "steps": steps})
    print(json.dumps({"keras": keras.__version__, "start": start.tolist(), "grads": grads.tolist(), "cases": cases}))


if __name__ == "__main__":
    main()
