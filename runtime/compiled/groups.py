"""The device groups of a compiled collective: how many devices each replica group holds, the
first group's devices, a permute's pairs, in every form XLA writes them (explicit lists, iota
forms, mesh-axis forms)."""
from __future__ import annotations

import math
import re

import numpy as np

from .hlo_text import _Instr, _matching_close, _split_top_level


_IOTA_RE = re.compile(r"\[\s*(\d+)\s*,\s*(\d+)\s*\]\s*<=")
_MESH_AXIS_RE = re.compile(r"\s*(?:'([^']*)'|\"([^\"]*)\"|([\w.\-]+))\s*=\s*(\d+)\s*")
_GROUP_AXIS_RE = re.compile(
    r"\s*(?:'([^']*)'|\"([^\"]*)\"|([\w.\-]+))\s*(?::\s*\(\s*\d+\s*\)\s*(\d+))?\s*"
)


def _explicit_group_size(text: str) -> int | None:
    """`{{0,1},{2,3}}` -> 2; `{}` (all devices) -> None."""
    groups = re.findall(r"\{([^{}]*)\}", text[1:-1])
    sizes = [len([x for x in g.split(",") if x.strip()]) for g in groups]
    return max(sizes) if sizes else None


def _mesh_form(attrs: str, pos: int) -> tuple[dict[str, int], list[int] | None, list[tuple[str | None, int]]] | None:
    """`mesh['a'=2,'b'=4], device_ids=(...) {'b'}` read: the mesh's axis sizes in order, its
    device ids (None: in order), and the grouped axes as (name, size); a sub-axis `'b':(1)2`
    has no name of its own (None) and its own size. None when the text does not parse."""
    bracket = attrs.index("[", pos)
    end = _matching_close(attrs, bracket)
    sizes: dict[str, int] = {}
    for part in _split_top_level(attrs[bracket + 1 : end - 1]):
        m = _MESH_AXIS_RE.fullmatch(part)
        if m is not None:
            sizes[m.group(1) or m.group(2) or m.group(3)] = int(m.group(4))
    rest = attrs[end:]
    device_ids: list[int] | None = None
    dev = re.match(r"\s*,\s*device_ids\s*=\s*\(", rest)
    if dev is not None:
        close = _matching_close(rest, dev.end() - 1)
        device_ids = _device_ids(rest[dev.end():close - 1], math.prod(sizes.values()))
        rest = rest[close:]
    axes = re.match(r"\s*\{", rest)
    if axes is None:
        return None
    grouped: list[tuple[str | None, int]] = []
    for part in _split_top_level(rest[axes.end() - 1 : _matching_close(rest, axes.end() - 1)][1:-1]):
        m = _GROUP_AXIS_RE.fullmatch(part)
        if m is None:
            return None
        axis = m.group(1) or m.group(2) or m.group(3)
        if m.group(4) is not None:
            grouped.append((None, int(m.group(4))))
        elif axis in sizes:
            grouped.append((axis, sizes[axis]))
        else:
            return None
    return sizes, device_ids, grouped


def _device_ids(text: str, count: int) -> list[int]:
    """A mesh's device ids, listed (`0,2,1,3`) or as an iota (`[2,4]T(1,0)`); [] if unread."""
    iota = re.fullmatch(r"\s*\[([\d,\s]+)\](?:\s*T\(([\d,\s]+)\))?\s*", text)
    if iota is not None:
        dims = [int(x) for x in iota.group(1).split(",") if x.strip()]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(2):
            ids = ids.transpose([int(x) for x in iota.group(2).split(",") if x.strip()])
        return [int(x) for x in ids.reshape(-1)]
    listed = [int(x) for x in re.findall(r"\d+", text)]
    return listed if len(listed) == count else []


def _mesh_group_size(attrs: str, pos: int) -> int:
    """`mesh['a'=1,'b'=4], device_ids=(...) {'b'}` -> 4: product of the grouped axis sizes (a
    sub-axis `'b':(1)2` contributes its own size); an empty axis set: each device alone."""
    form = _mesh_form(attrs, pos)
    return 0 if form is None else math.prod(size for _, size in form[2])


def _mesh_first_group(attrs: str, pos: int) -> tuple[int, ...]:
    """The devices of the first group of the mesh form: every index of the grouped axes, the
    others at 0; () with sub-axes (not read here)."""
    form = _mesh_form(attrs, pos)
    if form is None or any(name is None for name, _ in form[2]) or form[1] == []:
        return ()
    sizes, device_ids, grouped = form
    names = list(sizes)
    ids = np.asarray(device_ids if device_ids is not None else range(math.prod(sizes.values()))).reshape(
        list(sizes.values()))
    order = [names.index(name) for name, _ in grouped]
    ids = ids.transpose(order + [i for i in range(len(names)) if i not in order])
    return tuple(int(x) for x in ids.reshape(math.prod(size for _, size in grouped), -1)[:, 0])


def _group_size(instr: _Instr, module_devices: tuple[int, int] | None) -> int:
    """Devices per replica group from any of XLA's printed forms; 0 when undeterminable.

    Forms: explicit `{{0,1},{2,3}}`, iota `[2,4]<=[8]` / `[2,4]<=[4,2]T(1,0)` (groups x size),
    mesh `mesh[...] {axes}`. Empty `{}` means one group of every participant, whose number
    comes from the module header (replicas, times partitions when a channel_id is present).
    """
    m = re.search(r"\breplica_groups\s*=\s*", instr.attrs)
    if m is None:
        return _all_devices(instr, module_devices)
    pos = m.end()
    text = instr.attrs[pos:]
    try:
        if text.startswith("{"):
            size = _explicit_group_size(text[: _matching_close(text, 0)])
            return size if size is not None else _all_devices(instr, module_devices)
        if text.startswith("["):
            iota = _IOTA_RE.match(text)
            return int(iota.group(2)) if iota is not None else 0
        if text.startswith("mesh"):
            return _mesh_group_size(instr.attrs, pos)
        if text.startswith("maximal_mesh"):
            return 1
    except ValueError:
        return 0
    return 0


def _all_devices(instr: _Instr, module_devices: tuple[int, int] | None) -> int:
    if module_devices is None:
        return 0
    replicas, partitions = module_devices
    return replicas * partitions if "channel_id=" in instr.attrs else replicas


def _module_devices(hlo_text: str) -> tuple[int, int] | None:
    """(replica_count, num_partitions) from the `HloModule` header line, defaults 1."""
    header = re.search(r"^\s*HloModule\b.*$", hlo_text, re.MULTILINE)
    if header is None:
        return None
    line = header.group(0)
    replicas = re.search(r"\breplica_count=(\d+)", line)
    partitions = re.search(r"\bnum_partitions=(\d+)", line)
    return (
        int(replicas.group(1)) if replicas else 1,
        int(partitions.group(1)) if partitions else 1,
    )


_IOTA_FULL_RE = re.compile(r"\[\s*(\d+)\s*,\s*(\d+)\s*\]\s*<=\s*\[([\d,\s]+)\](?:\s*T\(([\d,\s]+)\))?")


def _first_group(instr: _Instr) -> tuple[int, ...]:
    """The device ids of the first replica group, from the explicit (`{{0,8},{1,9}}`), iota
    (`[8,4]<=[4,8]T(1,0)`) or mesh form; () where not read. The groups are alike, so one tells
    whether they cross hosts."""
    m = re.search(r"\breplica_groups\s*=\s*", instr.attrs)
    if m is None:
        return ()
    text = instr.attrs[m.end():]
    if text.startswith("mesh"):
        return _mesh_first_group(instr.attrs, m.end())
    if text.startswith("{{"):
        first = re.match(r"\{\{([\d,\s]*)\}", text)
        return tuple(int(x) for x in first.group(1).split(",") if x.strip()) if first else ()
    iota = _IOTA_FULL_RE.match(text)
    if iota is None:
        return ()
    groups, size = int(iota.group(1)), int(iota.group(2))
    dims = [int(x) for x in iota.group(3).split(",") if x.strip()]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if iota.group(4):
        ids = ids.transpose([int(x) for x in iota.group(4).split(",") if x.strip()])
    return tuple(int(x) for x in ids.reshape(groups, size)[0])


_PAIRS_RE = re.compile(r"\bsource_target_pairs\s*=\s*\{((?:\{\d+,\d+\},?)*)\}")


def _pairs(instr: _Instr) -> tuple[tuple[int, int], ...]:
    """A collective-permute's (source, target) pairs; () when the text does not list them."""
    m = _PAIRS_RE.search(instr.attrs)
    return tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))) if m else ()
