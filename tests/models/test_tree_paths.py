"""Parameter trees (``daskps._core.trees``) in this process, with real torch, Keras and JAX objects.

The expected paths are the frameworks' own: ``named_parameters()`` for a
torch module, ``variable.path`` for a Keras layer, ``tree_flatten_with_path``
keys for a JAX pytree.
"""

from __future__ import annotations

import collections
import dataclasses
import sys

import numpy as np
import pytest

from daskps._core import trees


@dataclasses.dataclass
class Cell:
    w: object
    b: object
    cache: object = dataclasses.field(default=None, init=False)


class NeedsArgs(dict):
    def __init__(self, config, items):
        super().__init__(items)


def test_every_python_container_round_trips_with_its_paths():
    Pair = collections.namedtuple("Pair", "w b")
    od = collections.OrderedDict(z=1)
    tree = {"d": collections.defaultdict(list, a=2), "o": od, "p": Pair(3, [4, (5,)]), "c": Cell(6, None),
            "s": "text", "y": b"raw"}
    paths, leaves, rebuild = trees.flatten(tree)
    assert [trees.join(p) for p in paths] == ["d/a", "o/z", "p/w", "p/b/0", "p/b/1/0", "c/w", "c/b", "s", "y"]
    assert leaves == [2, 1, 3, 4, 5, 6, None, "text", b"raw"]
    new = rebuild([x * 10 if isinstance(x, int) else x for x in leaves])
    assert new["d"] == {"a": 20} and type(new["d"]) is dict  # a defaultdict is remade as a dict
    assert type(new["o"]) is collections.OrderedDict and new["o"] == {"z": 10}
    assert new["p"] == Pair(30, [40, (50,)]) and type(new["p"]) is Pair
    assert new["c"] == Cell(60, None) and new["s"] == "text"


def test_a_dict_subclass_with_another_constructor_becomes_a_dict():
    paths, leaves, rebuild = trees.flatten(NeedsArgs(0, {"k": 1}))
    assert paths == [("k",)] and rebuild([2]) == {"k": 2}


def test_is_leaf_is_asked_first_about_every_node():
    tree = {"a": [1, 2], "b": {"c": 3}}
    asked = []
    paths, leaves, _ = trees.flatten(tree, is_leaf=lambda x: asked.append(x) or isinstance(x, list))
    assert paths == [("a",), ("b", "c")] and leaves == [[1, 2], 3]
    assert asked == [tree, [1, 2], {"c": 3}, 3]


@dataclasses.dataclass
class ArrayRecord:
    data: list

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.data, dtype=dtype)


class CpuOnly:
    """An array type with ``cpu()`` (as some accelerators' arrays) but no ``detach``."""

    def cpu(self):
        raise AssertionError("cpu() is only for torch tensors, which also have detach()")

    def __array__(self, dtype=None, copy=None):
        return np.array([1.0, 2.0])


def test_anything_with_array_is_a_leaf_even_a_dataclass():
    rec = ArrayRecord([1, 2])
    assert trees.is_array(rec)
    paths, leaves, _ = trees.flatten({"r": rec})
    assert paths == [("r",)] and leaves == [rec]


def test_to_numpy_calls_cpu_only_on_what_also_detaches():
    assert trees.to_numpy(CpuOnly()).tolist() == [1.0, 2.0]


def test_without_keras_imported_an_object_is_still_a_leaf(monkeypatch):
    for name in ("keras", "torch", "jax"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    obj = object()
    assert trees.flatten([obj])[1] == [obj]


def test_a_structure_missing_a_path_of_the_same_length_is_named():
    with pytest.raises(ValueError) as info:
        trees.match([("a",), ("c",)], [("a",), ("a",)], "grads", "variables")
    assert str(info.value) == "grads must have the structure of variables: variables has 'c', which grads lacks"


def test_describe_names_a_path_or_the_root():
    assert trees.describe(()) == "the root"
    assert trees.describe(("a", 0)) == "'a/0'"


def test_match_names_the_first_difference_exactly():
    assert trees.match([("a",), ("b",)], [("b",), ("a",)], "grads", "variables") == [1, 0]
    cases = [
        ([("a",)], [("a",), ("b",)], "grads must have the structure of variables: grads has 'b', which variables lacks"),
        ([("a",), ("c",)], [("a",)], "grads must have the structure of variables: variables has 'c', which grads lacks"),
        ([()], [("x",)], "grads must have the structure of variables: variables has the root, which grads lacks"),
        ([("a",), ("a",)], [("a",), ("a",), ("a",)], "grads must have the structure of variables: a path repeats"),
    ]
    for paths, other, message in cases:
        with pytest.raises(ValueError) as info:
            trees.match(paths, other, "grads", "variables")
        assert str(info.value) == message


def test_to_numpy_detaches_a_torch_tensor_that_requires_grad():
    torch = pytest.importorskip("torch")
    t = torch.ones(2, requires_grad=True) * 3
    got = trees.to_numpy(t)
    assert isinstance(got, np.ndarray) and got.tolist() == [3.0, 3.0]


def test_to_numpy_falls_back_to_dlpack():
    class OnlyDlpack:
        def __init__(self):
            self.a = np.arange(3.0)

        def __array__(self, *args, **kwargs):
            raise TypeError("no __array__ here")

        def __dlpack__(self, *args, **kwargs):
            return self.a.__dlpack__(*args, **kwargs)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    assert trees.to_numpy(OnlyDlpack()).tolist() == [0.0, 1.0, 2.0]
    assert trees.is_array(OnlyDlpack())

    class Neither:
        def __array__(self, *args, **kwargs):
            raise TypeError("no")

    with pytest.raises(TypeError, match="no"):
        trees.to_numpy(Neither())


def test_a_torch_module_is_its_named_parameters():
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    paths, leaves, rebuild = trees.flatten({"model": model})
    names = [n for n, _ in model.named_parameters()]
    assert [trees.join(p) for p in paths] == [f"model/{n}" for n in names]
    assert rebuild(list(range(len(names)))) == {"model": dict(zip(names, range(len(names))))}


def test_a_keras_layer_is_its_trainable_variables_by_path():
    keras = pytest.importorskip("keras")
    layer = keras.layers.Dense(2)
    layer.build((None, 3))
    paths, leaves, rebuild = trees.flatten(layer)
    assert [trees.join(p) for p in paths] == [v.path for v in layer.trainable_variables]
    assert leaves == list(layer.trainable_variables)


def test_a_jax_pytree_is_split_as_jax_splits_it():
    jax = pytest.importorskip("jax")

    @jax.tree_util.register_pytree_with_keys_class
    class Box:
        def __init__(self, a, b):
            self.a, self.b = a, b

        def tree_flatten_with_keys(self):
            return ((jax.tree_util.GetAttrKey("a"), self.a), (jax.tree_util.GetAttrKey("b"), self.b)), None

        @classmethod
        def tree_unflatten(cls, aux, children):
            return cls(*children)

    paths, leaves, rebuild = trees.flatten({"box": Box([1, 2], 3)})
    assert paths == [("box", "a", 0), ("box", "a", 1), ("box", "b")] and leaves == [1, 2, 3]
    new = rebuild([4, 5, 6])["box"]
    assert type(new) is Box and new.a == [4, 5] and new.b == 6


def test_a_jax_node_with_one_child_is_still_split():
    jax = pytest.importorskip("jax")

    @jax.tree_util.register_pytree_with_keys_class
    class One:
        def __init__(self, a):
            self.a = a

        def tree_flatten_with_keys(self):
            return ((jax.tree_util.GetAttrKey("a"), self.a),), None

        @classmethod
        def tree_unflatten(cls, aux, children):
            return cls(*children)

    paths, leaves, rebuild = trees.flatten({"one": One(3)})
    assert paths == [("one", "a")] and leaves == [3]
    assert rebuild([4])["one"].a == 4


def test_jax_keys_by_kind():
    jax = pytest.importorskip("jax")
    tu = jax.tree_util
    assert trees.jax_key(tu.DictKey("k")) == "k"
    assert trees.jax_key(tu.GetAttrKey("n")) == "n"
    assert trees.jax_key(tu.SequenceKey(2)) == 2
    assert trees.jax_key(tu.FlattenedIndexKey(3)) == 3
    assert trees.jax_key("other") == "other"
    assert trees.jax_key(7) == "7"


def test_an_unknown_object_is_a_leaf_even_with_jax_loaded():
    pytest.importorskip("jax")
    obj = object()
    paths, leaves, _ = trees.flatten([obj])
    assert paths == [(0,)] and leaves == [obj]


def test_something_with_only_dlpack_is_an_array():
    class OnlyDlpack:
        def __dlpack__(self, *args, **kwargs):
            return np.arange(2.0).__dlpack__(*args, **kwargs)

        def __dlpack_device__(self):
            return np.arange(2.0).__dlpack_device__()

    assert trees.is_array(OnlyDlpack())
    assert not trees.is_array([1.0]) and not trees.is_array(object())
    assert trees.to_numpy(OnlyDlpack()).tolist() == [0.0, 1.0]


def test_to_numpy_of_other_objects_is_numpys_asarray():
    got = trees.to_numpy([None, 1])
    assert got.dtype == object and got.tolist() == [None, 1]
