"""Draft trees as tensors (the hot path); their static shapes and specs are in ``specdec.tree_spec``.

A tree hangs below the root, the request's pending token (verify token 0). Node i is
verify token i + 1; nodes are in topological order (parent index < child index), so
every per-node array can be filled in one forward sweep. See docs/design.md, "Trees".
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

if TYPE_CHECKING:
    from specdec.tree_spec import TreeTemplate

MAX_TREE_NODES = 63  # with the root: 64 verify tokens, one int64 bitmask per node
ROOT = -1  # parent index of the root's children; also the root's id in children()/path_to()


class HostView(NamedTuple):
    """Host (Python list) copies of a tree's integer arrays."""

    tokens: list[int]
    parents: list[int]
    depth: list[int]
    ancestor_mask: list[int]
    children: dict[int, list[int]]  # ROOT and every node -> children in index order


def _describe(t: object) -> str:
    return f"Tensor(shape={tuple(t.shape)}, dtype={t.dtype})" if isinstance(t, Tensor) else type(t).__name__


def _int_vector(name: str, t: object, n: int | None) -> Tensor:
    if not isinstance(t, Tensor) or t.dtype != torch.int64 or t.dim() != 1:
        raise ValueError(f"{name} must be a 1-D int64 tensor, got {_describe(t)}")
    if n is not None and t.shape[0] != n:
        raise ValueError(f"{name} must have shape ({n},) like tokens, got {tuple(t.shape)}")
    return t


def depths_and_masks(parents: Sequence[int]) -> tuple[list[int], list[int]]:
    """Depth (0 under the root) and ancestor bitmask (self included) of topologically ordered nodes."""
    depth: list[int] = []
    mask: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"parents[{i}] must be in [-1, {i - 1}] (topological order), got {p}")
        depth.append(0 if p < 0 else depth[p] + 1)
        mask.append((1 << i) | (0 if p < 0 else mask[p]))
    return depth, mask


def _check_range(name: str, got: list[int], want: list[int] | tuple[int, int | None], why: str = "") -> None:
    """Raise ValueError naming name[i] where got differs from the list want or leaves [lo, hi)."""
    if isinstance(want, list):
        if got == want:
            return
        i = next(i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w)
        raise ValueError(f"{name}[{i}] must be {want[i]} ({why}), got {got[i]}")
    lo, hi = want
    if not got or (min(got) >= lo and (hi is None or max(got) < hi)):
        return
    i = next(i for i, g in enumerate(got) if g < lo or (hi is not None and g >= hi))
    allowed = f">= {lo}" if hi is None else f"in [{lo}, {hi})"
    raise ValueError(f"{name}[{i}] must be {allowed}{' ' + why if why else ''}, got {got[i]}")


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A token tree below the pending token, validated at construction.

    tokens, parents, depth, ancestor_mask: (N,) int64 on one device, N <= 63. Verification needs no draft
    distribution (each committed token is the target's own choice), so a tree holds tokens only.
    Construction reads the small integer arrays to the host once (one sync on GPU).
    """

    tokens: Tensor  # (N,)
    parents: Tensor  # (N,)
    depth: Tensor  # (N,)
    ancestor_mask: Tensor  # (N,)

    def __post_init__(self) -> None:
        n = _int_vector("tokens", self.tokens, None).shape[0]
        if n > MAX_TREE_NODES:
            raise ValueError(f"tokens: a tree has at most {MAX_TREE_NODES} nodes, got {n}")
        for name in ("parents", "depth", "ancestor_mask"):
            _int_vector(name, getattr(self, name), n)
        for name in ("parents", "depth", "ancestor_mask"):
            t = getattr(self, name)
            if t.device != self.tokens.device:
                raise ValueError(f"{name} is on {t.device}, tokens on {self.tokens.device}")
        object.__setattr__(self, "_host", self._read_host())
        self._check_values()

    def _check_values(self) -> None:
        h = self.host
        depth, mask = depths_and_masks(h.parents)
        _check_range("depth", h.depth, depth, "the parent's depth + 1")
        _check_range("ancestor_mask", h.ancestor_mask, mask, "the parent's mask | (1 << i)")
        _check_range("tokens", h.tokens, (0, None))

    @property
    def host(self) -> HostView:
        """Python-list copies of the integer arrays and the children table, read once."""
        return self._host

    def _read_host(self) -> HostView:
        rows = torch.stack([self.tokens, self.parents, self.depth, self.ancestor_mask])
        tokens, parents, depth, mask = rows.tolist()  # one device->host copy, (4, N)
        return HostView(tokens, parents, depth, mask, _children(parents))

    @classmethod
    def empty(cls, device: torch.device | str = "cpu") -> DraftTree:
        """A tree with no nodes: verification then samples only the bonus token (plain decoding).

        Trees are immutable, so one instance per device is shared."""
        tree = _EMPTY.get(device)  # keyed by the argument as given, then by the normalised device
        if tree is None:
            key = str(torch.device(device))
            if key not in _EMPTY:
                z = torch.zeros(0, dtype=torch.int64, device=device)
                _EMPTY[key] = cls(z, z.clone(), z.clone(), z.clone())
            tree = _EMPTY[device] = _EMPTY[key]
        return tree

    @classmethod
    def chain(cls, tokens: list[int]) -> DraftTree:
        """A chain of host token ids below the root, on the CPU.

        The hot path of model-free drafters: its arrays are right by construction, so it skips the
        validation that ``from_parents`` runs, every other array (tensors and host lists, read-only like
        every tree's) is shared by all chains of the same length, and the ``tokens`` tensor is made on
        first use (the graphed greedy step reads only the host view)."""
        return cls.chains([tokens])[0]

    @classmethod
    def chains(cls, rows: list[list[int]]) -> list[DraftTree]:
        """``chain`` of each token list in ``rows`` (a model-free drafter's batch), each length's shape looked
        up once; ValueError past ``MAX_TREE_NODES`` tokens."""
        shapes, trees, of_shape = {}, [], cls._of_shape
        for tokens in rows:
            n = len(tokens)
            parts = shapes.get(n)
            if parts is None:
                if not n:
                    trees.append(cls.empty())
                    continue
                if n > MAX_TREE_NODES:
                    raise ValueError(f"tokens: a tree has at most {MAX_TREE_NODES} nodes, got {n}")
                parts = shapes[n] = _chain_parts(n)
            trees.append(of_shape(tokens, parts))
        return trees

    @classmethod
    def of_template(cls, tokens: list[int], template: TreeTemplate) -> DraftTree:
        """A tree of ``template``'s shape holding host token ids (one per node), on the CPU.

        Like ``chain``: the shape's arrays come from the (validated) template and are shared by all its
        trees, so only the tokens are new."""
        if len(tokens) != template.num_nodes:
            raise ValueError(f"tokens: the template has {template.num_nodes} nodes, got {len(tokens)} tokens")
        return cls._of_shape(tokens, _shape_parts(template.parents))

    @classmethod
    def of_parents(cls, tokens: list[int], parents: list[int]) -> DraftTree:
        """A tree of host token ids under host ``parents`` (-1: the root; topologically
        ordered, else ValueError), on the CPU: ``of_template`` for shapes that seldom repeat (no networkx
        check, nothing cached)."""
        n = len(tokens)
        if n != len(parents) or n > MAX_TREE_NODES:
            raise ValueError(f"tokens and parents must have one length <= {MAX_TREE_NODES}, got {n} and {len(parents)}")
        if not n:
            return cls.empty()
        plist = list(parents)
        depth, masks = depths_and_masks(plist)
        tree = object.__new__(cls)  # every other tensor is made on first use (``__getattr__``)
        tree.__dict__["_host"] = HostView(list(tokens), plist, depth, masks, _children(plist))
        return tree

    @classmethod
    def of_template_rows(cls, rows: list[list[int]], template: TreeTemplate) -> list[DraftTree]:
        """``of_template`` for each token list in ``rows`` (a batch's trees of one shape), the shape looked up once."""
        n = template.num_nodes
        if any(len(tokens) != n for tokens in rows):
            bad = next(len(tokens) for tokens in rows if len(tokens) != n)
            raise ValueError(f"rows: the template has {n} nodes, got a row of {bad} tokens")
        parts = _shape_parts(template.parents)
        return [cls._of_shape(tokens, parts) for tokens in rows]

    @classmethod
    def _of_shape(cls, tokens: list[int], parts) -> DraftTree:
        """A tree of host ``tokens`` over shared shape arrays ``parts`` (``_shape_parts``)."""
        parents, depth, masks, children, fields = parts
        tree = object.__new__(cls)
        state = tree.__dict__
        state.update(fields)
        state["_host"] = _new_host(HostView, (list(tokens), parents, depth, masks, children))
        return tree

    @classmethod
    def from_parents(cls, tokens: Sequence[int] | Tensor, parents: Sequence[int] | Tensor,
                     device: torch.device | str | None = None) -> DraftTree:
        """Build a tree from tokens and parent indices, computing depth and ancestor_mask."""
        if device is None:
            device = tokens.device if isinstance(tokens, Tensor) else "cpu"
        plist = parents.tolist() if isinstance(parents, Tensor) else list(parents)
        depth, mask = depths_and_masks(plist)
        as_i64 = lambda v: torch.as_tensor(v, dtype=torch.int64).to(device).reshape(-1)
        return cls(as_i64(tokens), as_i64(plist), as_i64(depth), as_i64(mask))

    def __getattr__(self, name: str):
        """Only for attributes not set: an integer array of a tree built from host lists (the ``tokens`` of
        ``chain`` and ``of_template``, the arrays of ``of_parents``), made from the host view on first use."""
        host = self.__dict__.get("_host")
        if name not in _LAZY_ARRAYS or host is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        array = self.__dict__[name] = torch.tensor(getattr(host, name), dtype=torch.int64)  # (N,)
        return array

    @property
    def num_nodes(self) -> int:
        return len(self.host.tokens)

    @property
    def max_depth(self) -> int:
        """Number of node levels below the root (max(depth) + 1; 0 for an empty tree)."""
        depth = self.__dict__.get("_max_depth")
        if depth is None:  # a tree never changes: computed once (trees of a shared shape come with it)
            depth = self.__dict__["_max_depth"] = max(self.host.depth, default=-1) + 1
        return depth

    def children(self, i: int) -> list[int]:
        """Node indices whose parent is i (i = -1: the root), in index order."""
        if not -1 <= i < self.num_nodes:
            raise ValueError(f"node index must be in [-1, {self.num_nodes}), got {i}")
        return list(self.host.children[i])

    def path_to(self, i: int) -> list[int]:
        """Node indices from the root's child down to node i (root excluded; [] for i = -1)."""
        if not -1 <= i < self.num_nodes:
            raise ValueError(f"node index must be in [-1, {self.num_nodes}), got {i}")
        path = []
        while i != ROOT:
            path.append(i)
            i = self.host.parents[i]
        return path[::-1]

    def verify_tree_mask(self) -> Tensor:
        """(N+1,) int64 attention mask rows of the verify tokens: bit j = may attend verify token j."""
        root = torch.ones(1, dtype=torch.int64, device=self.tokens.device)
        return torch.cat([root, 1 | (self.ancestor_mask << 1)])  # bit 63 wraps to the sign bit

    def verify_rows(self) -> tuple[list[int], list[int]]:
        """Host twins of the verify token arrays: the values of ``verify_tree_mask`` as Python ints (bit 63
        as the int64 sign), and each verify token's parent verify index (-1 for the root)."""
        rows = self.__dict__.get("verify_rows_of")
        if rows is None:  # a tree never changes: computed once
            rows = self.__dict__["verify_rows_of"] = verify_rows_of(self.host.ancestor_mask, self.host.parents)
        return rows

    def to(self, device: torch.device | str) -> DraftTree:
        """The same tree on another device."""
        return DraftTree(self.tokens.to(device), self.parents.to(device), self.depth.to(device),
                         self.ancestor_mask.to(device))


_EMPTY: dict = {}  # device (as given, and as str) -> the shared empty tree
_new_host = tuple.__new__  # HostView from a filled tuple, without the named constructor's call
_LAZY_ARRAYS = ("tokens", "parents", "depth", "ancestor_mask")  # tensors a host-list tree makes on first use


def verify_rows_of(ancestor_mask: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
    masks = [1] + [1 | (m << 1) for m in ancestor_mask]
    return [m - (1 << 64) if m >= 1 << 63 else m for m in masks], [-1] + [p + 1 for p in parents]


def _children(parents: list[int]) -> dict[int, list[int]]:
    """ROOT and every node -> its children in index order."""
    children: dict[int, list[int]] = {ROOT: []}
    for i, p in enumerate(parents):
        children.setdefault(i, [])
        children.setdefault(p, []).append(i)
    return children


@functools.cache
def _shape_parts(parents: tuple[int, ...]):
    """The arrays every tree of this (validated) shape shares: host lists, children, and the
    instance fields (tensors by field name, verify rows). At most 63 nodes, so every mask fits a signed int64."""
    plist = list(parents)
    depth, masks = depths_and_masks(plist)
    arrays = dict(zip(("parents", "depth", "ancestor_mask"),
                      torch.tensor([plist, depth, masks], dtype=torch.int64)))  # 3 x (N,)
    fields = dict(verify_rows_of=verify_rows_of(masks, plist), _max_depth=max(depth, default=-1) + 1, **arrays)
    return plist, depth, masks, _children(plist), fields


@functools.cache
def _chain_parts(n: int):
    """The arrays every n-node chain shares (``_shape_parts``, looked up by length)."""
    return _shape_parts(tuple(range(-1, n - 1)))
