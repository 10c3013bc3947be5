"""rr_client's public surface: the root facade is exactly the union of its layers' ``__all__`` (so a public name
cannot go missing), each lazy layer's table agrees with its static TYPE_CHECKING imports (the huggingface_hub rule),
every public name resolves and every error names ``rr_client`` as its module (httpx's rule), and no shim package remains."""

from __future__ import annotations

import ast
import importlib
import pickle
from pathlib import Path

import pytest

import rr_client
import rr_client.client
import rr_client.core
import rr_client.trainer

LAYERS = (rr_client.core, rr_client.client, rr_client.trainer)


def _lazy_and_typed(module: object) -> tuple[dict[str, str], dict[str, str]]:
    """(_LAZY, TYPE_CHECKING imports name -> module) read from a lazy layer's ``__init__`` source."""
    tree = ast.parse(Path(module.__file__).read_text())  # type: ignore[attr-defined]
    lazy: dict[str, str] = {}
    typed: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_LAZY":
            lazy = ast.literal_eval(node.value)
        elif isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                typed.update({a.name: str(imp.module) for a in imp.names})
    return lazy, typed


def test_root_exports_are_the_union_of_the_layers() -> None:
    union = [name for layer in LAYERS for name in layer.__all__]
    assert len(union) == len(set(union)), "a name is offered by two layers"
    assert sorted(rr_client.__all__) == sorted(union)


def test_every_error_class_is_public() -> None:
    """The drift the facade rules out: a class of the error tree missing from the root (ServerStartError was)."""
    from rr_client.core import errors

    classes = {
        n
        for n, v in vars(errors).items()
        if isinstance(v, type) and issubclass(v, Exception) and v.__module__ in ("rr_client", errors.__name__)
    }
    assert classes <= set(rr_client.__all__), sorted(classes - set(rr_client.__all__))
    assert rr_client.ServerStartError is errors.ServerStartError


@pytest.mark.parametrize("layer", [rr_client.client, rr_client.trainer], ids=lambda m: m.__name__)
def test_lazy_layers_table_and_type_checking_imports_agree(layer: object) -> None:
    lazy, typed = _lazy_and_typed(layer)
    submodules = {n for n, m in typed.items() if m == layer.__name__}  # type: ignore[attr-defined]
    assert lazy == {n: m for n, m in typed.items() if n not in submodules}
    assert set(lazy) <= set(layer.__all__)  # type: ignore[attr-defined]


def test_every_public_name_resolves_and_errors_name_rr_client() -> None:
    """Errors name the public import (tracebacks, pickles); hinted classes keep their home so hints resolve."""
    import typing

    for name in sorted(rr_client.__all__):
        value = getattr(rr_client, name)
        assert value is not None, name
        if isinstance(value, type) and issubclass(value, BaseException):
            assert value.__module__ == "rr_client", (name, value.__module__)
    assert repr(rr_client.ShapeMismatchError) == "<class 'rr_client.ShapeMismatchError'>"
    assert typing.get_type_hints(rr_client.CheckedRouting)["array"].__name__ == "ndarray"


def test_public_errors_pickle_by_their_public_name() -> None:
    """Errors cross processes (Ray, multiprocessing) by ``__module__`` + name: the rewritten module must resolve."""
    err = pickle.loads(pickle.dumps(rr_client.ShapeMismatchError("rows 3 != 4")))
    assert type(err) is rr_client.ShapeMismatchError and str(err) == "rows 3 != 4"


def test_unknown_names_raise_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        rr_client.nope  # noqa: B018
    with pytest.raises(AttributeError, match="rr_client.client"):
        rr_client.client.nope  # noqa: B018


def test_no_shim_remains() -> None:
    """Nothing was released: the compatibility packages are gone, names live where they are imported from."""
    for old in ("rr_client.replay", "rr_client.metrics", "rr_client.codec", "rr_client._client"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)


def test_replica_stats_is_public() -> None:
    """``RoutedExpertsClient.replica_stats()`` returns it, so users can name it."""
    from rr_client.client._replicas import ReplicaStats

    assert rr_client.ReplicaStats is ReplicaStats
