"""The kernels a compiled program runs, each with XLA's count of its FLOPs and bytes.

A device runs a program kernel after kernel: a fusion, a library call (cuDNN, cuBLAS), a copy.
Each is bound by its own roofline, max(flops / F, bytes / bandwidth), so a step's compute is
the sum of those (`compiled_cost.price_compiled`). One roofline over the program's totals
would let one kernel's idle memory bandwidth pay for another's FLOPs: in a step of
compute-bound convolutions and memory-bound optimizer updates the updates would cost nothing,
and a plan that shards them (ZeRO) would gain nothing.

Each kernel is priced by XLA's generic cost analysis (`jax_internals.hlo_cost_analysis`, the
CPU client's: a GPU's client runs none) of a module of its own: the instruction as ENTRY's
root, its operands as parameters, the computations it calls (fused computations, reducers).
The control flow around kernels (ENTRY, while bodies and conditions, conditional branches,
calls, async wrappers) is walked, each kernel weighted by how often its computation runs per
step (`collectives.computation_runs`: loop trips counted, every branch as if taken).
Collectives are not kernels here: communication prices them.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import jax

from rhino_jax.hlo_passes.jax_internals import UnsupportedJaxError, hlo_cost_analysis

from .collectives import COLLECTIVE_KINDS, _kind_of, computation_runs
from .hlo_text import (_CALLEE_RE, _INSTR_HEAD_RE, _LEAF_RE, _REF_RE, ComputationRuns, _computations, _elements, _Instr,
                       _leaf_bytes, _leaves, _parse_shape)

__all__ = ["Kernel", "program_kernels", "parseable", "module_header"]

# Instructions that run no kernel of their own: buffers, control flow, the async halves whose
# work is a collective or a called computation (walked), markers.
_NOT_KERNELS = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
    "async-start", "async-update", "async-done", "copy-done", "send", "send-done", "recv", "recv-done",
    "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
})
# Attributes naming computations that run as control flow (their instructions are kernels) rather
# than inside one kernel (a fusion's `calls`, a reduce's `to_apply`).
_CONTROL = frozenset({"body", "condition", "branch_computations", "true_computation", "false_computation"})
_RUNS_CALLEES = frozenset({"call", "async-start"})  # `to_apply`/`calls` of these are control flow too
_CONTROL_PREDECESSORS_RE = re.compile(r",\s*control-predecessors=\{[^{}]*\}")


@dataclass(frozen=True)
class Kernel:
    """One kernel of a compiled program, per device."""

    name: str
    opcode: str
    computation: str
    runs: int  # per step: loop trips counted, every branch of a conditional as if taken
    flops: float  # per run
    bytes_accessed: float  # per run

    def run_seconds(self, flop_rate: float, bandwidth: float) -> float:
        """Its time per run at its own roofline."""
        return max(self.flops / flop_rate, self.bytes_accessed / bandwidth)

    def seconds(self, flop_rate: float, bandwidth: float) -> float:
        """Its time per step at its own roofline."""
        return self.runs * self.run_seconds(flop_rate, bandwidth)


def parseable(text: str) -> str:
    """HLO text XLA's parser takes back: the stack frames it prints refer to a table it does not,
    and the aliasing it prints on async collectives' starts it refuses there (an in-place
    buffer: nothing the cost analysis counts)."""
    text = re.sub(r",?\s*stack_frame_id=\d+", "", text)
    return _ASYNC_START_RE.sub(lambda m: _ALIASING_RE.sub("", m.group(0)), text)


# An async collective's start as GPU XLA prints it (jax 0.12: `all-reduce-start(...), ...,
# output_to_operand_aliasing={{1}: (0, {})}`): its parser admits that attribute on custom calls
# and fusions only.
_ASYNC_START_RE = re.compile(r"^.*\b(?:%s)-start\(.*$" % "|".join(COLLECTIVE_KINDS), re.MULTILINE)
_ALIASING_RE = re.compile(r",\s*output_to_operand_aliasing=\{(?:[^{}]|\{(?:[^{}]|\{[^{}]*\})*\})*\}")


def module_header(text: str) -> str:
    """An `HloModule` line keeping the device counts, without the entry's layout (it changes)."""
    counts = " ".join(f", {k}={v}" for k, v in re.findall(r"\b(num_partitions|replica_count)=(\d+)",
                                                             text.split("\n", 1)[0]))
    return f"HloModule kernel{counts}"


def _callees(instr: _Instr, control: bool) -> list[str]:
    """The computations `instr` names: those that run as control flow, or (control=False) all."""
    out = []
    for key, value in _CALLEE_RE.findall(instr.attrs):
        if not control or key in _CONTROL or instr.opcode in _RUNS_CALLEES:
            out += re.findall(r"%?([\w.\-]+)", value)
    return out


def _is_kernel(instr: _Instr) -> bool:
    op = instr.opcode
    return not (op in _NOT_KERNELS or _kind_of(op) is not None or op.endswith("-done")
                or (op.endswith("-start") and op != "copy-start"))


def _instruction_lines(texts: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Every instruction's line and its result's shape as written (layout kept), by name."""
    lines, shapes = {}, {}
    for block in texts.values():
        for line in block.splitlines()[1:-1]:
            head = _INSTR_HEAD_RE.match(line)
            if head is None:
                continue
            try:
                _, end = _parse_shape(line, head.end())
            except ValueError:
                continue
            lines[head.group(1)] = line.strip().removeprefix("ROOT ")
            shapes[head.group(1)] = line[head.end():end].strip()
    return lines, shapes


def _kernel_module(instr: _Instr, header: str, comps: dict[str, list[_Instr]], texts: dict[str, str],
                   lines: dict[str, str], shapes: dict[str, str]) -> str:
    """A module of `instr` alone: its operands as parameters, the computations it calls."""
    called: list[str] = []
    todo = _callees(instr, control=False)
    while todo:
        name = todo.pop()
        if name not in called and name in texts:
            called.append(name)
            todo += [c for i in comps[name] for c in _callees(i, control=False)]
    operands = list(dict.fromkeys(_REF_RE.findall(instr.operands)))
    body = [f"  %{o} = {shapes[o]} parameter({k})" for k, o in enumerate(operands)]
    body.append("  ROOT " + _CONTROL_PREDECESSORS_RE.sub("", lines[instr.name]))
    entry = "ENTRY %kernel {\n" + "\n".join(body) + "\n}"
    return "\n\n".join([header, *(texts[c] for c in reversed(called)), entry])


def _own_bytes(instr: _Instr, shapes: dict[str, str]) -> float:
    """Operands read and result written, from their shapes: for library calls, whose bytes XLA's
    generic analysis does not know (it says -1)."""
    names = list(dict.fromkeys(_REF_RE.findall(instr.operands)))
    leaves = [leaf for n in names for leaf in _leaves(_parse_shape(shapes[n], 0)[0])] + _leaves(instr.shape)
    return float(sum(_leaf_bytes(leaf) for leaf in leaves))


def program_kernels(text: str) -> tuple[tuple[Kernel, ...], ComputationRuns]:
    """Every kernel of the compiled program `text` with its FLOPs and bytes per run (library
    calls' FLOPs, which XLA's analysis leaves out, from `library_flops`),
    and how often each computation runs."""
    comps, texts, entry = _computations(text)
    if not entry:
        raise ValueError("no ENTRY computation in the HLO text; pass compiled.as_text()")
    module = computation_runs(text, every_branch=True)
    control, todo = [], [entry]
    while todo:
        name = todo.pop()
        if name not in control and name in comps:
            control.append(name)
            todo += [c for i in comps[name] for c in _callees(i, control=True)]
    lines, shapes = _instruction_lines(texts)
    header, cpu = module_header(text), jax.devices("cpu")[0]
    kernels = []
    for comp in control:
        for instr in filter(_is_kernel, comps[comp]):
            kernel = parseable(_kernel_module(instr, header, comps, texts, lines, shapes))
            try:
                cost = hlo_cost_analysis(kernel, cpu)
            except UnsupportedJaxError:
                raise
            except Exception as e:  # XLA may reject the module: say which kernel and why
                raise RuntimeError(f"cannot price kernel {instr.name!r} ({instr.opcode}) of computation "
                                   f"{comp!r} on its own with this jaxlib ({type(e).__name__}: {e})") from e
            nbytes = float(cost.get("bytes accessed", 0.0))
            kernels.append(Kernel(
                instr.name, instr.opcode, comp, module.runs.get(comp, 0),
                float(cost.get("flops", 0.0)) + sum(library_flops(kernel).values()),
                nbytes if nbytes >= 0 else _own_bytes(instr, shapes)))
    return tuple(kernels), module


# Which of a cuDNN convolution's operands and result are the forward convolution's input, kernel
# and output (its dim_labels always describe the forward one).
_CONV_ROLES = {"convForward": ("input", "kernel", "output"), "convBiasActivationForward": ("input", "kernel", "output"),
               "convBackwardInput": ("output", "kernel", "input"), "convBackwardFilter": ("input", "output", "kernel")}
_CUDNN_RE = re.compile(r'custom_call_target="__cudnn\$(\w+)"')
_DIM_LABELS_RE = re.compile(r"\bdim_labels=(\w+)_(\w+)->(\w+)")
_CUBLAS_RE = re.compile(r'custom_call_target="__cublas\$[\w$]*(?:gemm|matmul)[\w$]*"')
_LHS_CONTRACTING_RE = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


def _dims(leaf: str) -> list[int]:
    return [int(d) for d in _LEAF_RE.match(leaf).group(2).split(",") if d.strip()]


def _conv_flops(instr: _Instr, operands: list) -> float | None:
    """A cuDNN convolution: 2 x its forward output's elements x the kernel's elements / its
    output features; a backward one as its forward twin, whose shapes its operands and result are."""
    target, labels = _CUDNN_RE.search(instr.attrs), _DIM_LABELS_RE.search(instr.attrs)
    if target is None or labels is None or target.group(1) not in _CONV_ROLES:
        return None
    tensors = dict(zip(_CONV_ROLES[target.group(1)], operands[:2] + [_leaves(instr.shape)[0]]))
    if any(not isinstance(t, str) for t in tensors.values()):
        return None  # an operand whose shape the text does not give: not counted
    kernel_dims = _dims(tensors["kernel"])
    return 2.0 * _elements(tensors["output"]) * math.prod(kernel_dims) / max(kernel_dims[labels.group(2).index("o")], 1)


def _gemm_flops(instr: _Instr, operands: list) -> float | None:
    """A cuBLAS GEMM: 2 x its output's elements (the result's first leaf; a workspace follows) x
    the left operand's contracted elements (the backend config's dot dimension numbers)."""
    contracting = _LHS_CONTRACTING_RE.search(instr.attrs)
    if _CUBLAS_RE.search(instr.attrs) is None or contracting is None or not isinstance(operands[0], str):
        return None
    lhs = _dims(operands[0])
    contracted = math.prod(lhs[int(d.strip().strip('"'))] for d in contracting.group(1).split(",") if d.strip())
    return 2.0 * _elements(_leaves(instr.shape)[0]) * contracted


def library_flops(hlo_text: str) -> dict[str, float]:
    """FLOPs of the library calls in each computation (each instruction once): GPU XLA compiles
    a convolution to a cuDNN call and may compile a dot to a cuBLAS one (the real device's
    compiler does, for some shapes), whose FLOPs XLA's generic cost analysis (what a GPU's
    program is priced by) does not count."""
    comps, _, _ = _computations(hlo_text)
    shapes = {i.name: i.shape for instrs in comps.values() for i in instrs}
    out: dict[str, float] = {}
    for comp, instrs in comps.items():
        for i in instrs:
            if i.opcode != "custom-call":
                continue
            operands = [shapes.get(name) for name in _REF_RE.findall(i.operands)]
            if not operands:
                continue
            flops = _conv_flops(i, operands)
            flops = _gemm_flops(i, operands) if flops is None else flops
            if flops is not None:
                out[comp] = out.get(comp, 0.0) + flops
    return out
