"""Static tree shapes (``TreeTemplate``, checked with networkx), the tree specs users name ('chain:K', 'topk:WxD',
'dynamic:B'), and pictures of trees (``draw_tree``)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import networkx as nx

from specdec.tree import MAX_TREE_NODES, ROOT, DraftTree, depths_and_masks


@dataclass(frozen=True)
class TreeTemplate:
    """A fixed tree shape: parents[i] of node i (-1 = root); a node's rank among its siblings
    says which draft top-k token it gets. Checked with networkx to be a topologically ordered
    arborescence of at most 63 nodes."""

    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "parents", tuple(int(p) for p in self.parents))
        n = len(self.parents)
        if n > MAX_TREE_NODES:
            raise ValueError(f"parents: a tree has at most {MAX_TREE_NODES} nodes, got {n}")
        bad = [i for i, p in enumerate(self.parents) if not -1 <= p < n]
        if bad:
            raise ValueError(f"parents[{bad[0]}] must be in [-1, {n}), got {self.parents[bad[0]]}")
        g = self.graph()
        if not nx.is_directed_acyclic_graph(g) or not nx.is_arborescence(g):
            raise ValueError(f"parents must form a tree below the root, got {self.parents}")
        if any(p >= i for i, p in enumerate(self.parents)):
            raise ValueError(f"parents must be topologically ordered (parent < child), got {self.parents}")

    def graph(self) -> nx.DiGraph:
        """Directed tree with node -1 as the root and edges parent -> child."""
        g = nx.DiGraph()
        g.add_node(ROOT)
        g.add_nodes_from(range(len(self.parents)))
        g.add_edges_from((p, i) for i, p in enumerate(self.parents))
        return g

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> tuple[int, ...]:
        return tuple(depths_and_masks(self.parents)[0])

    @property
    def ranks(self) -> tuple[int, ...]:
        """Rank of each node among its siblings (0 = the parent's most probable draft token)."""
        seen: dict[int, int] = {}
        out = []
        for p in self.parents:
            out.append(seen.get(p, 0))
            seen[p] = out[-1] + 1
        return tuple(out)


def chain_template(k: int) -> TreeTemplate:
    """A chain of k nodes (1 <= k <= 63)."""
    if not 1 <= k <= MAX_TREE_NODES:
        raise ValueError(f"chain length k must be in [1, {MAX_TREE_NODES}], got {k}")
    return TreeTemplate(tuple(range(-1, k - 1)))


def topk_template(width: int, depth: int) -> TreeTemplate:
    """Full tree: every node above the last level has `width` children, `depth` levels, level order."""
    if width < 1 or depth < 1:
        raise ValueError(f"width and depth must be >= 1, got width={width}, depth={depth}")
    n = sum(width**d for d in range(1, depth + 1))
    if n > MAX_TREE_NODES:
        raise ValueError(f"topk {width}x{depth} has {n} nodes; at most {MAX_TREE_NODES} allowed")
    parents, level = [], [ROOT]
    for _ in range(depth):
        nxt = []
        for p in level:
            for _ in range(width):
                nxt.append(len(parents))
                parents.append(p)
        level = nxt
    return TreeTemplate(tuple(parents))


TREE_SPEC_KINDS = ("chain", "topk", "dynamic")
_SPEC_FORMS = ("'chain:K', 'topk:WxD', 'dynamic:B' or 'dynamic:B:KxD' (1 <= nodes <= 63), e.g. 'topk:2x3', "
               "'dynamic:32:8x6'")
DYNAMIC_MAX_WIDTH = 16  # most nodes of one level of a dynamic tree with an explicit shape


@dataclass(frozen=True)
class TreeSpec:
    """A drafter's tree shape. chain: width 1, `depth` nodes; topk: `width` children per node,
    `depth` levels; dynamic: up to `budget` nodes grown by cumulative draft probability, either
    unconstrained (width = depth = 0: the drafter's default levels) or `depth` levels of `width`
    nodes each (a frontier of `width` nodes, each with its `width` best children as candidates),
    then the best `budget` nodes. The draft KV of the first depth - 1 levels must fit the 63-slot
    tree region (width * (depth - 1) <= 63) and budget <= width * depth. `budget` is the node count
    (filled in for static kinds)."""

    kind: str
    width: int = 0
    depth: int = 0
    budget: int = 0

    def __post_init__(self) -> None:
        if self.kind not in TREE_SPEC_KINDS:
            raise ValueError(f"kind must be one of {TREE_SPEC_KINDS}, got {self.kind!r}")
        if self.kind == "chain":
            if self.width not in (0, 1):
                raise ValueError(f"width of a chain must be 1, got {self.width}")
            object.__setattr__(self, "width", 1)
        if self.kind == "dynamic":
            if not 1 <= self.budget <= MAX_TREE_NODES:
                raise ValueError(f"budget must be in [1, {MAX_TREE_NODES}], got {self.budget}")
            self._check_dynamic_shape()
            return
        n = self.template().num_nodes
        if self.budget not in (0, n):
            raise ValueError(f"budget of {self.kind} {self.width}x{self.depth} must be {n}, "
                             f"got {self.budget}")
        object.__setattr__(self, "budget", n)

    def _check_dynamic_shape(self) -> None:
        w, d = self.width, self.depth
        if (w, d) == (0, 0):
            return
        if not 1 <= w <= DYNAMIC_MAX_WIDTH:
            raise ValueError(f"width of a dynamic tree must be in [1, {DYNAMIC_MAX_WIDTH}], got {w}")
        if not 1 <= d or w * (d - 1) > MAX_TREE_NODES:
            raise ValueError(f"depth of a dynamic tree of width {w} must be in [1, {MAX_TREE_NODES // w + 1}] "
                             f"(width * (depth - 1) <= {MAX_TREE_NODES}), got {d}")
        if self.budget > w * d:
            raise ValueError(f"budget of dynamic {w}x{d} must be in [1, {w * d}] (width * depth), got {self.budget}")

    @property
    def k(self) -> int:
        """Chain length (the depth of a chain)."""
        return self.depth

    @property
    def is_static(self) -> bool:
        return self.kind != "dynamic"

    def template(self) -> TreeTemplate:
        """The fixed shape of a chain or topk spec; dynamic trees have none (ValueError)."""
        if self.kind == "chain":
            return chain_template(self.depth)
        if self.kind == "topk":
            return topk_template(self.width, self.depth)
        raise ValueError(f"kind {self.kind!r} has no static template")

    def __str__(self) -> str:
        return {"chain": f"chain:{self.depth}", "topk": f"topk:{self.width}x{self.depth}",
                "dynamic": f"dynamic:{self.budget}" + (f":{self.width}x{self.depth}" if self.width else "")}[self.kind]


def template_from_spec(spec: str) -> TreeSpec:
    """Parse 'chain:K', 'topk:WxD', 'dynamic:B' or 'dynamic:B:KxD' into a validated TreeSpec."""
    s = spec.strip().lower() if isinstance(spec, str) else ""
    if m := re.fullmatch(r"chain:(\d+)", s):
        return TreeSpec("chain", width=1, depth=int(m[1]))
    if m := re.fullmatch(r"topk:(\d+)x(\d+)", s):
        return TreeSpec("topk", width=int(m[1]), depth=int(m[2]))
    if m := re.fullmatch(r"dynamic:(\d+)(?::(\d+)x(\d+))?", s):
        return TreeSpec("dynamic", width=int(m[2] or 0), depth=int(m[3] or 0), budget=int(m[1]))
    raise ValueError(f"tree spec {spec!r} not understood; allowed forms: {_SPEC_FORMS}")


def _tidy_layout(g: nx.DiGraph) -> dict[int, tuple[float, float]]:
    """Leaves left to right in DFS order, parents centred over their children, y = -level."""
    pos: dict[int, tuple[float, float]] = {}
    leaves = iter(range(len(g)))

    def place(u: int, level: int) -> float:
        kids = sorted(g.successors(u))
        x = sum(place(c, level + 1) for c in kids) / len(kids) if kids else float(next(leaves))
        pos[u] = (x, -float(level))
        return x

    place(ROOT, 0)
    return pos


def draw_tree(tree: DraftTree | TreeTemplate, path: str | Path, accepted: Sequence[int] = (),
              title: str | None = None) -> Path:
    """Write a picture of the tree (tokens as labels, `accepted` nodes highlighted) to `path`.
    Needs matplotlib (the `bench` extra); raises ImportError naming it otherwise."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("draw_tree needs matplotlib: pip install 'specdec[bench]'") from e
    if isinstance(tree, DraftTree):
        g = TreeTemplate(tuple(tree.host.parents)).graph()
        labels = {i: str(t) for i, t in enumerate(tree.host.tokens)}
    else:
        g = tree.graph()
        labels = {i: f"#{r}" for i, r in enumerate(tree.ranks)}
    labels[ROOT] = "root"
    pos = _tidy_layout(g)
    on = set(accepted) | {ROOT}
    fig = Figure(figsize=(max(4.0, 0.6 * len(g)), 1.2 * (1 + max(-y for _, y in pos.values()))))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors = ["tab:green" if u in on else "lightgray" for u in g.nodes]
    nx.draw_networkx(g, pos, ax=ax, labels=labels, node_color=colors, node_size=500, font_size=8,
                     arrows=False)
    ax.set_axis_off()
    if title:
        ax.set_title(title)
    out = Path(path)
    fig.savefig(out, bbox_inches="tight")
    return out
