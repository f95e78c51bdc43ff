"""The jax versions rhino_jax supports: the one module that uses jax internals
(hlo_passes/jax_internals.py) works on the installed jax, says which jax range to install when it
does not, and nothing else reaches into jax's private modules."""
import pathlib
import re

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest
from jax.extend.mlir import ir
from jax.sharding import NamedSharding, PartitionSpec as P
from packaging.specifiers import SpecifierSet

import rhino_jax as rj
from rhino_jax.hlo_passes import jax_internals as internals
from rhino_jax.hlo_passes.jax_internals import UnsupportedJaxError

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_setup_pins_the_supported_range_and_it_is_installed():
    setup = (ROOT / "setup.py").read_text()
    for package, version in (("jax", jax.__version__), ("jaxlib", jaxlib.__version__)):
        assert f'"{package}{internals.SUPPORTED_JAX}"' in setup, package
        assert version in SpecifierSet(internals.SUPPORTED_JAX), (package, version)


def test_only_jax_internals_uses_private_jax():
    private = re.compile(r"\bjax\._src\b|\bjaxlib\._|from jaxlib import _|\._lowering\b")
    sources = [p for folder in ("rhino_jax", "hlo_passes", "search", "runtime", "benchmarks")
               for p in (ROOT / folder).rglob("*.py")]
    assert len(sources) > 20
    users = {str(p.relative_to(ROOT)) for p in sources if private.search(p.read_text())}
    assert users == {"hlo_passes/jax_internals.py"}, users


def test_compile_replacing_module_runs_the_new_module_and_leaves_the_lowering_alone():
    mesh = rj.device_mesh((2,), ("x",), jax.devices()[:2])
    sharding = NamedSharding(mesh, P("x"))
    x = jnp.arange(8.0)
    lowered = jax.jit(lambda v: v + 1, in_shardings=sharding, out_shardings=sharding).lower(x)
    doubled = jax.jit(lambda v: v * 2).lower(x).compiler_ir("stablehlo")
    replicated = NamedSharding(mesh, P())
    compiled = internals.compile_replacing_module(lowered, doubled, [replicated], [replicated])
    assert isinstance(compiled, jax.stages.Compiled)
    np.testing.assert_array_equal(compiled(x), np.arange(8.0) * 2)
    assert compiled.input_shardings[0][0].is_equivalent_to(replicated, 1)
    np.testing.assert_array_equal(lowered.compile()(x), np.arange(8.0) + 1)


def test_compile_replacing_module_names_the_supported_range_when_lowered_differs():
    lowered = jax.jit(lambda v: v + 1).lower(jnp.ones(4))
    module = lowered.compiler_ir("stablehlo")
    object.__setattr__(lowered, "_lowering", object())  # a jax whose Lowered keeps something else
    with pytest.raises(UnsupportedJaxError, match=re.escape(f"jax{internals.SUPPORTED_JAX}")) as err:
        internals.compile_replacing_module(lowered, module, [], [])
    assert jax.__version__ in str(err.value) and "jax.stages.Lowered" in str(err.value)


def test_ir_context_parses_jax_stablehlo():
    text = jax.jit(lambda v: jnp.sin(v) @ v).lower(jnp.ones((4, 4))).as_text()
    with internals.ir_context():
        module = ir.Module.parse(text)
        names = [op.operation.name for op in module.body.operations[0].regions[0].blocks[0].operations]
    assert "stablehlo.dot_general" in names, names


def test_ir_context_names_the_supported_range_when_jax_gives_no_module(monkeypatch):
    monkeypatch.setattr(jax.stages.Lowered, "compiler_ir", lambda self, dialect=None: None)
    with pytest.raises(UnsupportedJaxError, match=re.escape(f"jax{internals.SUPPORTED_JAX}")):
        internals.ir_context()


def test_hlo_cost_analysis_names_the_supported_range_when_jaxlib_moves_it(monkeypatch):
    import jaxlib._jax  # the internal that jax_internals looks up

    monkeypatch.delattr(jaxlib._jax, "hlo_module_cost_analysis")
    with pytest.raises(UnsupportedJaxError, match=re.escape(f"jax{internals.SUPPORTED_JAX}")):
        internals.hlo_cost_analysis("HloModule m", jax.devices()[0])


def test_hlo_cost_analysis_counts_a_matmul():
    a, b = jnp.ones((4, 8)), jnp.ones((8, 16))
    text = jax.jit(jnp.matmul).lower(a, b).compile().as_text()
    cost = internals.hlo_cost_analysis(text, jax.devices()[0])
    cost = cost[0] if isinstance(cost, list) else cost
    assert cost["flops"] == 2 * 4 * 8 * 16, cost


def test_top_k_lowered_as_sort_gives_xla_s_top_k_and_is_undone_after():
    """The stand-in for lax.top_k while a step is lowered: the same values and indices as XLA's
    TopK, ties (also 0.0 and -0.0) to the lower index, NaNs in the total order; jax's own lowering
    back once the block ends. (Three functions: jax.jit caches per function.)"""
    rows = np.array([[1.0, np.nan, 3.0, -np.nan, 2.0, np.inf, 3.0],
                     [0.0, -0.0, 0.0, -0.0, 1.0, -np.inf, 1.0]], np.float32)

    def by_xla(x):
        return jax.lax.top_k(x, 4)

    def by_sort(x):
        return jax.lax.top_k(x, 4)

    def after(x):
        return jax.lax.top_k(x, 4)

    with internals.top_k_lowered_as_sort():
        lowered = jax.jit(by_sort).lower(rows)
    assert "top_k" not in lowered.as_text() and "sort" in lowered.as_text()
    for want, got in zip(jax.jit(by_xla)(rows), lowered.compile()(rows)):
        np.testing.assert_array_equal(np.asarray(want), np.asarray(got))
    assert "top_k" in jax.jit(after).lower(rows).as_text()


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_key_impl_of_a_key_dtype_wraps_its_key_data_back(impl):
    key = jax.random.key(7, impl=impl)
    back = jax.random.wrap_key_data(jax.random.key_data(key), impl=internals.key_impl_of(key.dtype))
    assert back.dtype == key.dtype
    np.testing.assert_array_equal(jax.random.key_data(back), jax.random.key_data(key))


def test_key_impl_of_names_the_supported_range_when_a_key_dtype_has_none():
    with pytest.raises(UnsupportedJaxError, match=r"install a jax and jaxlib in that range"):
        internals.key_impl_of(np.dtype(np.uint32))
