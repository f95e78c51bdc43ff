"""`plan.render(path)`: one self-contained HTML page (inline SVG, no scripts, nothing fetched) of a
plan: every layer's large tensors over the mesh, the collectives per layer and, for a pipeline,
its schedule as a timeline of stages and micro-batches (placed by the schedule's own simulation,
`Schedule.timeline`, with the stages' predicted times)."""
from __future__ import annotations

import html
import os
from collections import defaultdict

import numpy as np

from rhino_jax.hlo_passes.graph import dtype_size, path_tokens
from rhino_jax.search.specs import ShardingSpec

from .explain import all_collectives, arg_layers, by_kind, describe, op_layer, plan_axes
from .plan import Plan, PlannedCollective, mesh_label, place_name

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
                 "Predicted time of each collective alone (before XLA combines them), summed by kind for the ops "
                 "of each layer (named scopes of the op's source name); a pipeline's stage programs once per "
                 "micro-batch.", collectives_svg(plan))]
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
    axes = plan_axes(plan)
    colors: dict[str, str] = {}
    rows, y = [], 30
    for layer, members in layers.items():
        lines = -(-len(members) // PER_ROW)
        rows.append(f'<text x="4" y="{y + 16}" font-weight="bold">{_e(layer[:34])}</text>')
        for k, i in enumerate(members):
            x, top = LABEL_W + (k % PER_ROW) * CELL_W, y + (k // PER_ROW) * CELL_H
            rows.append(_tensor(plan, i, axes, x, top, colors, layer))
        y += lines * CELL_H
    legend = [f'<rect x="{4 + 110 * k}" y="6" width="12" height="12" fill="{color}"/>'
              f'<text x="{20 + 110 * k}" y="16">{_e(key or "replicated")}</text>'
              for k, (key, color) in enumerate(sorted(colors.items()))]
    width = LABEL_W + PER_ROW * CELL_W
    return _svg(width, y + 10, legend + rows)


def _tensor(plan: Plan, i: int, axes: dict[str, int], x: float, y: float, colors: dict[str, str], layer: str) -> str:
    """One argument in its cell: its name, its shape drawn as a rectangle cut into the blocks the
    devices hold (rows: dim 0, columns: the rest), its layout."""
    shape, spec, path = plan.arg_shapes[i], plan.arg_specs[i], plan.arg_paths[i]
    rows, cols = shape[0], int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    w = max(BOX * min(1.0, cols / max(rows, 1)), 14.0)
    h = max(BOX * min(1.0, rows / max(cols, 1)), 14.0)
    cut_r, cut_c = (ShardingSpec.shard_factor_of(tuple(a for d in dims for a in d), axes)
                    for dims in (spec.dims[:1], spec.dims[1:]))
    key = "+".join(a for a in axes if a in spec.used_axes() and axes[a] > 1)  # an axis of size 1 splits nothing
    color = colors.setdefault(key, REPLICATED if not key else PALETTE[len([k for k in colors if k]) % len(PALETTE)])
    x0, y0 = x + (BOX - w) / 2 + 10, y + 22 + (BOX - h) / 2
    blocks = [f'<rect x="{x0 + c * w / cut_c:.1f}" y="{y0 + r * h / cut_r:.1f}" width="{w / cut_c:.1f}" '
              f'height="{h / cut_r:.1f}" fill="{color}" fill-opacity="{0.95 if (r + c) % 2 else 0.6}" '
              'stroke="#fff" stroke-width="0.5"/>' for r in range(cut_r) for c in range(cut_c)]
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype_size(plan.arg_dtypes[i])
    title = (f"{path}\n{plan.arg_roles[i]} {tuple(shape)} {plan.arg_dtypes[i]}, {nbytes / 2**10:.1f} KiB\n"
             f"{spec}: {describe(spec, shape, axes)}")
    return (f'<g class="tensor" data-path="{_e(path)}" data-layout="{_e(str(spec))}"><title>{_e(title)}</title>'
            f'<text x="{x}" y="{y + 14}">{_e(_short(path, layer))}</text>' + "".join(blocks)
            + f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{w:.1f}" height="{h:.1f}" fill="none" stroke="#333"/>'
            f'<text x="{x}" y="{y + 22 + BOX + 16}">{_e(str(spec))}</text>'
            f'<text x="{x}" y="{y + 22 + BOX + 30}" fill="#666">{_e(str(tuple(shape)))}</text></g>')


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
    """Per layer (in the order its first collective runs), a bar of its collectives' predicted
    time, one segment per kind, with bytes and time beside it."""
    grouped: dict[str, list[PlannedCollective]] = defaultdict(list)
    layers = arg_layers(plan)
    for c in all_collectives(plan):
        grouped[op_layer(c.where, layers)].append(c)
    per = {layer: by_kind(cs) for layer, cs in grouped.items()}
    if not per:
        return _svg(400, 30, ['<text x="4" y="18">no collectives: every tensor is read where it is</text>'])
    kinds = sorted({k for kinds_of in per.values() for k in kinds_of})
    color = {k: PALETTE[j % len(PALETTE)] for j, k in enumerate(kinds)}
    longest = max(sum(t for _, _, t in kinds_of.values()) for kinds_of in per.values()) or 1.0
    scale, bar_x = 520 / longest, LABEL_W + 60
    out = [f'<rect x="{4 + 130 * j}" y="6" width="12" height="12" fill="{color[k]}"/>'
           f'<text x="{20 + 130 * j}" y="16">{_e(k)}</text>' for j, k in enumerate(kinds)]
    y = 30
    for layer, kinds_of in per.items():
        out.append(f'<text x="4" y="{y + 12}">{_e((layer or "(ops outside named layers)")[:40])}</text>')
        x = bar_x
        for kind, (n, b, t) in kinds_of.items():
            title = f"{layer or '(ops outside named layers)'}: {kind} ×{n}, {b / 2**10:.1f} KiB, {t * 1e6:.1f} µs alone"
            out.append(f'<rect class="collective" data-layer="{_e(layer)}" data-kind="{_e(kind)}" x="{x:.1f}" '
                       f'y="{y}" width="{max(t * scale, 1):.1f}" height="16" fill="{color[kind]}">'
                       f"<title>{_e(title)}</title></rect>")
            x += max(t * scale, 1)
        total_b = sum(b for _, b, _ in kinds_of.values())
        total_t = sum(t for _, _, t in kinds_of.values())
        out.append(f'<text x="{x + 6:.1f}" y="{y + 12}">{total_b / 2**10:.1f} KiB, {total_t * 1e6:.1f} µs</text>')
        y += 22
    return _svg(bar_x + 700, y + 8, out)


def schedule_svg(plan: Plan) -> str:
    """The pipeline's timeline: a row per stage, a box per (pass, micro-batch) where the schedule's
    simulation (`Schedule.timeline`) places it, then each stage's apply-gradients."""
    s = plan.search_stats
    p, k = len(plan.stages), s["micro_batches"]
    schedule = plan.schedule()
    fwd, bwd = [st.forward_s for st in plan.stages], [st.backward_s for st in plan.stages]
    times = schedule.timeline(lambda t: (fwd if t.kind == "F" else bwd)[t.stage], s["transfer_s"])
    apply_at = max(end for _, end in times.values()) + sum(s.get(m, 0.0) for m in
                                                           ("arguments_in_s", "sums_out_s", "outputs_out_s"))
    boxes = [(t.kind, t.stage, t.micro_batch, start, end) for t, (start, end) in times.items()]
    boxes += [("A", st.stage, -1, apply_at, apply_at + st.apply_s) for st in plan.stages]
    scale, x0 = 760 / max(max(b[4] for b in boxes), 1e-30), 210
    fill = {"F": "#8fbce6", "B": "#f4a582", "A": "#9bd39b"}
    out = []
    for st in plan.stages:
        name = place_name(st.stage, tuple(s.get("shared_places", ())), s.get("passes", 1), len(plan.stages))
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
