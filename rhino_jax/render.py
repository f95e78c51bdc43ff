"""`plan.render(path)`: one self-contained HTML page (inline SVG, no scripts, nothing fetched) of a
plan: every layer's large tensors over the mesh, the collectives per layer and, for a pipeline,
its schedule as a timeline of stages and micro-batches (placed by the schedule's own simulation,
`Schedule.timeline`, with the stages' predicted times)."""
from __future__ import annotations

import dataclasses
import functools
import html
import os
from collections import defaultdict

import numpy as np

from rhino_jax.hlo_passes.graph import dtype_size, path_tokens
from rhino_jax.core.plan import Plan, PlannedCollective, place_name
from rhino_jax.core.plan_file import mesh_label
from rhino_jax.core.specs import ShardingSpec

from .plan_view import (Kind, all_collectives, arg_layers, arg_meshes, by_kind, describe, op_layer, plan_axes,
                        times)

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f")
REPLICATED = "#d9d9d9"
CELL_W, CELL_H, LABEL_W, PER_ROW, BOX = 150, 118, 220, 6, 60


def render(plan: Plan, path: str | os.PathLike) -> None:
    """Write the page of `plan` to `path`."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(page(plan))


def page(plan: Plan) -> str:
    """The whole HTML page: a section, each with one <svg>, per picture."""
    c = plan.cost
    sections = [("layouts", "Layouts of each layer's tensors over the mesh",
                 "Arguments of two or more dims, grouped by the module path in their names. A tensor is drawn "
                 "rows (dim 0) by columns (its other dims), cut into one block per piece a device holds; the "
                 "colour says which mesh axes split it" + (", over its stage's sub-mesh" if plan.stages else "")
                 + ". Hover for the layout in words.", layouts_svg(plan)),
                ("collectives", "Collectives per layer",
                 "The collectives of each layer's ops (named scopes of the op's source name), summed by kind, sized "
                 "by their predicted time in the step: XLA combines independent collectives of one kind into one "
                 "op, whose time is split among its members by bytes, so a small collective combined with large "
                 "ones costs little and the bars add up to the step's communication (a pipeline's: each "
                 "program's, stage programs once per micro-batch). Hover for the count, bytes and the time they "
                 "would take alone, uncombined.", collectives_svg(plan))]
    if plan.stages:
        sections.append(("schedule", "Pipeline schedule",
                         "One row per stage; a box per forward (F) and backward (B) pass of each micro-batch, placed "
                         "where the schedule's simulation starts it with the stages' predicted times and the "
                         "transfer between stages, then each stage's apply-gradients (A) after the moves between "
                         "the stages' meshes.", schedule_svg(plan)))
    body = [f"<h1>rhino_jax plan: mesh {_e(mesh_label(plan.mesh_axes))}, cluster {_e(plan.cluster)}, "
            f"{_e(plan.opt_level)}</h1>",
            f"<p>Predicted step {c.total_s * 1e3:.4g} ms"
            + ("" if plan.stages else f" (compute {c.compute_s * 1e3:.4g} ms, communication {c.comm_s * 1e3:.4g} ms)")
            + f", {c.memory_bytes / 2**20:.2f} MiB per device.</p>"]
    for key, title, caption, svg in sections:
        body.append(f'<section id="{key}"><h2>{_e(title)}</h2><p>{_e(caption)}</p>{svg}</section>')
    body.append(f"<details><summary>plan.report()</summary><pre>{_e(plan.report())}</pre></details>")
    style = ("body{font-family:sans-serif;margin:24px;color:#222}svg{font-size:11px}section{margin-bottom:32px}"
             "pre{font-size:12px}")
    return ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>rhino_jax plan</title>'
            f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def layouts_svg(plan: Plan) -> str:
    """Per layer, its arguments of two or more dims (all arguments where none has two) as a grid
    of blocks, one per piece, coloured by the mesh axes that split it."""
    ranks = [len(s) for s in plan.arg_shapes]
    large = [i for i, r in enumerate(ranks) if r >= 2] or [i for i, r in enumerate(ranks) if r >= 1]
    layer_of, layers = arg_layers(plan), defaultdict(list)
    for i in large:
        layers[layer_of[plan.arg_paths[i]]].append(i)
    meshes = arg_meshes(plan)  # an interlaced pipeline's arguments on every device, the others on their stage's
    colors: dict[str, str] = {}
    rows, y = [], 30
    for layer, members in layers.items():
        lines = -(-len(members) // PER_ROW)
        rows.append(f'<text x="4" y="{y + 16}" font-weight="bold">{_e(layer[:34])}</text>')
        for k, i in enumerate(members):
            x, top = LABEL_W + (k % PER_ROW) * CELL_W, y + (k // PER_ROW) * CELL_H
            rows.append(_tensor(plan, i, meshes[i][0] if meshes else plan_axes(plan), x, top, colors, layer))
        y += lines * CELL_H
    legend = [f'<rect x="{4 + 110 * k}" y="6" width="12" height="12" fill="{color}"/>'
              f'<text x="{20 + 110 * k}" y="16">{_e(key or "replicated")}</text>'
              for k, (key, color) in enumerate(sorted(colors.items()))]
    width = LABEL_W + PER_ROW * CELL_W
    return _svg(width, y + 10, legend + rows)


def _tensor(plan: Plan, i: int, axes: dict[str, int], x: float, y: float, colors: dict[str, str], layer: str) -> str:
    """One argument in its cell: its name, its shape drawn as a rectangle cut into the blocks the
    devices hold (rows: dim 0, columns: the rest), its layout."""
    shape, named, path = plan.arg_shapes[i], plan.arg_specs[i], plan.arg_paths[i]
    spec = splitting(named, axes)
    rows, cols = shape[0], int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    w = max(BOX * min(1.0, cols / max(rows, 1)), 14.0)
    h = max(BOX * min(1.0, rows / max(cols, 1)), 14.0)
    cut_r, cut_c = (ShardingSpec.shard_factor_of(tuple(a for d in dims for a in d), axes)
                    for dims in (spec.dims[:1], spec.dims[1:]))
    key = "+".join(a for a in axes if a in spec.used_axes())
    color = colors.setdefault(key, REPLICATED if not key else PALETTE[len([k for k in colors if k]) % len(PALETTE)])
    x0, y0 = x + (BOX - w) / 2 + 10, y + 22 + (BOX - h) / 2
    blocks = [f'<rect x="{x0 + c * w / cut_c:.1f}" y="{y0 + r * h / cut_r:.1f}" width="{w / cut_c:.1f}" '
              f'height="{h / cut_r:.1f}" fill="{color}" fill-opacity="{0.95 if (r + c) % 2 else 0.6}" '
              'stroke="#fff" stroke-width="0.5"/>' for r in range(cut_r) for c in range(cut_c)]
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype_size(plan.arg_dtypes[i])
    idle = [a for a in named.used_axes() if a not in spec.used_axes()]
    title = (f"{path}\n{plan.arg_roles[i]} {tuple(shape)} {plan.arg_dtypes[i]}, {nbytes / 2**10:.1f} KiB\n"
             f"{spec}: {describe(spec, shape, axes)}"
             + (f"\nthe plan names it {named}: {', '.join(idle)} of one device here" if idle else ""))
    return (f'<g class="tensor" data-path="{_e(path)}" data-layout="{_e(str(named))}"><title>{_e(title)}</title>'
            f'<text x="{x}" y="{y + 14}">{_e(_short(path, layer))}</text>' + "".join(blocks)
            + f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{w:.1f}" height="{h:.1f}" fill="none" stroke="#333"/>'
            f'<text x="{x}" y="{y + 22 + BOX + 16}">{_e(str(spec))}</text>'
            f'<text x="{x}" y="{y + 22 + BOX + 30}" fill="#666">{_e(str(tuple(shape)))}</text></g>')


def splitting(spec: ShardingSpec, axes: dict[str, int]) -> ShardingSpec:
    """`spec` less the mesh axes of one device (a stage's sub-mesh keeps the whole mesh's axis
    names, some of size 1): the axes that split the tensor, as the picture and its legend show."""
    return dataclasses.replace(spec, dims=tuple(tuple(a for a in d if axes[a] > 1) for d in spec.dims))


def _short(path: str, layer: str) -> str:
    """An argument's name inside its layer: its path less the layer's keys and the indices (an
    optimizer's chain), "mu kernel" for arg[1][0].mu['Block_0']['Dense_0']['kernel'] in
    Block_0/Dense_0."""
    whole = [text for _, text in path_tokens(path)]
    inner, texts = layer.split("/"), whole
    for j in range(len(whole) - len(inner) + 1):
        if whole[j:j + len(inner)] == inner:
            texts = whole[:j] + whole[j + len(inner):]
            break
    words = [t for t in texts if not t.isdigit()] or whole[-1:] or [path]
    return " ".join(words)[:24]


def collectives_svg(plan: Plan) -> str:
    """Per layer (in the order its first collective runs), a bar of its collectives' time in the
    step (`PlannedCollective.combined_s`; alone in a plan saved without it), one segment per kind,
    on a time scale, with bytes and times beside it."""
    grouped: dict[str, list[PlannedCollective]] = defaultdict(list)
    layers = arg_layers(plan)
    collectives = all_collectives(plan)
    for c in collectives:
        grouped[op_layer(c.where, layers)].append(c)
    in_step = all(c.combined_s is not None for c in collectives)
    per = {layer: {kind: k for kind, k in by_kind(cs).items() if _time(k) > 0}
           for layer, cs in grouped.items()}
    per = {layer: kinds_of for layer, kinds_of in per.items() if kinds_of}  # no empty bars
    if not per:
        return _svg(400, 30, ['<text x="4" y="18">no collectives: every tensor is read where it is</text>'])
    kinds = sorted({kind for kinds_of in per.values() for kind in kinds_of})
    color = {kind: PALETTE[j % len(PALETTE)] for j, kind in enumerate(kinds)}
    total = sum(_time(k) for kinds_of in per.values() for k in kinds_of.values())
    longest = max(sum(_time(k) for k in kinds_of.values()) for kinds_of in per.values())
    bar_x, bar_w = LABEL_W + 60, 520
    scale = bar_w / longest
    out = [f'<rect x="{4 + 130 * j}" y="6" width="12" height="12" fill="{color[kind]}"/>'
           f'<text x="{20 + 130 * j}" y="16">{_e(kind)}</text>' for j, kind in enumerate(kinds)]
    out.append(f'<text x="4" y="36">{_e(_sum_line(plan, total, in_step))}</text>')
    y = 48
    for layer, kinds_of in per.items():
        name = layer or "(ops outside named layers)"
        out.append(f'<text x="4" y="{y + 12}">{_e(name[:40])}</text>')
        x = bar_x
        for kind, k in kinds_of.items():
            w = max(_time(k) * scale, 1.0)  # a share too small to see still shows
            title = f"{name}: {kind} ×{k.count}, {k.bytes / 2**10:.1f} KiB, {times(k)}"
            out.append(f'<rect class="collective" data-layer="{_e(layer)}" data-kind="{_e(kind)}" '
                       f'data-seconds="{_time(k):.6g}" x="{x:.1f}" y="{y}" width="{w:.1f}" height="16" '
                       f'fill="{color[kind]}"><title>{_e(title)}</title></rect>')
            x += w
        summed = functools.reduce(Kind.add, grouped[layer], Kind())
        out.append(f'<text x="{x + 6:.1f}" y="{y + 12}">{summed.bytes / 2**10:.1f} KiB, {_e(times(summed))}'
                   "</text>")
        y += 22
    out += _scale(bar_x, y + 4, bar_w, longest)
    return _svg(bar_x + 700, y + 34, out)


def _time(k: Kind) -> float:
    """What a bar shows of collectives summed by kind: their time in the step, else (a plan saved
    without it) alone."""
    return k.alone_s if k.combined_s is None else k.combined_s


def _sum_line(plan: Plan, total: float, in_step: bool) -> str:
    """What the bars add up to, beside the predicted step's figure it matches (or does not)."""
    if not in_step:
        return (f"Each collective alone (this plan was saved without its combined times): {total * 1e3:.4g} ms in "
                f"all, where the predicted step's communication, combined, is {plan.cost.comm_s * 1e3:.4g} ms")
    if plan.stages:
        return (f"{total * 1e3:.4g} ms in all over the step's programs (stage programs once per micro-batch; the "
                "schedule runs stages side by side)")
    return f"{total * 1e3:.4g} ms in all: the predicted step's communication"


def _scale(x0: float, y: float, width: float, longest: float) -> list[str]:
    """A time axis under the bars: a line from 0 to `longest` seconds over `width` pixels, ticked
    at round numbers of µs."""
    step = next(m * 10.0 ** e for e in range(-3, 12) for m in (1, 2, 5) if longest * 1e6 / (m * 10.0 ** e) <= 6)
    out = [f'<line x1="{x0}" y1="{y}" x2="{x0 + width}" y2="{y}" stroke="#333"/>']
    for t in np.arange(0.0, longest * 1e6 * (1 + 1e-9), step):
        x = x0 + t / (longest * 1e6) * width
        out.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}" stroke="#333"/>'
                   f'<text class="tick" x="{x:.1f}" y="{y + 16}" text-anchor="middle">{t:g} µs</text>')
    return out


def schedule_svg(plan: Plan) -> str:
    """The pipeline's timeline: a row per stage, a box per (pass, micro-batch) where the schedule's
    simulation (`Schedule.timeline`) places it, then each stage's apply-gradients."""
    s, e = plan.search_stats.staging, plan.execution
    p, k = len(plan.stages), e.micro_batches
    schedule = plan.schedule()
    fwd, bwd = [st.forward_s for st in plan.stages], [st.backward_s for st in plan.stages]
    times = schedule.timeline(lambda t: (fwd if t.kind == "F" else bwd)[t.stage], e.transfer_s)
    apply_at = max(end for _, end in times.values()) + s.arguments_in_s + s.sums_out_s + s.outputs_out_s
    boxes = [(t.kind, t.stage, t.micro_batch, start, end) for t, (start, end) in times.items()]
    boxes += [("A", st.stage, -1, apply_at, apply_at + st.apply_s) for st in plan.stages]
    scale, x0 = 760 / max(max(b[4] for b in boxes), 1e-30), 210
    fill = {"F": "#8fbce6", "B": "#f4a582", "A": "#9bd39b"}
    out = []
    for st in plan.stages:
        name = place_name(st.stage, e.shared_places, e.passes, len(plan.stages))
        out.append(f'<text x="4" y="{30 + 30 * st.stage + 15}">{_e(name)} {_e(mesh_label(st.mesh_axes))}</text>')
    for kind, stage, mb, start, end in sorted(boxes, key=lambda b: (b[1], b[3])):
        x, w, y = x0 + start * scale, max((end - start) * scale, 1.0), 30 + 30 * stage
        label = f"{kind}{mb}" if kind != "A" else "A"
        span = f"{label}@{stage}: {start * 1e3:.4g}-{end * 1e3:.4g} ms"
        out.append(f'<rect class="task" data-stage="{stage}" data-pass="{kind}" data-micro-batch="{mb}" '
                   f'x="{x:.2f}" y="{y}" width="{w:.2f}" height="22" fill="{fill[kind]}" stroke="#333" '
                   f'stroke-width="0.5"><title>{_e(span)}</title></rect>')
        if w >= 16:
            out.append(f'<text x="{x + w / 2:.2f}" y="{y + 15}" text-anchor="middle">{label}</text>')
    axis_y = 30 + 30 * p + 14
    end_ms = max(b[4] for b in boxes) * 1e3
    out.append(f'<text x="{x0}" y="{axis_y}">0 ms</text><text x="{x0 + 760}" y="{axis_y}" text-anchor="end">'
               f"{end_ms:.4g} ms ({_e(schedule.name)}, {p} stages, {k} micro-batches)</text>")
    return _svg(x0 + 780, axis_y + 10, out)


def _svg(width: float, height: float, parts: list[str]) -> str:
    return (f'<svg width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}">' + "".join(parts) + "</svg>")


def _e(text: str) -> str:
    return html.escape(text, quote=True)
