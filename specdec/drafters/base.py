"""The drafter interface: propose a token tree for each speculating row."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import NamedTuple

from specdec.scheduler.request import Request
from specdec.tree import DraftTree


class Proposal(NamedTuple):
    """Trees for the rows, and per row the nodes whose draft KV was written (None: no draft KV). ``device``: the
    trees are still on the device (a ``fused_step.DeviceDraft``: ``trees`` is filled once the verify that
    ``Verifier.verify_proposal`` launches behind the draft is read), or they belong to a step already queued on
    the device (a ``pipeline.QueuedStep``, adopted by ``pipeline.StepPipeline``); None: host trees."""

    trees: Sequence[DraftTree]
    draft_computed: list[frozenset[int] | None]
    device: object | None = None


class Drafter(ABC):
    """Grows draft trees. ``max_nodes`` bounds every tree (the scheduler reserves that many slots)."""

    max_nodes: int = 0
    uses_kv: bool = False  # True when the drafter keeps a model's KV in the shared pool
    budget: int | None = None  # nodes allowed in this step's trees (set by the adaptive controller); None: max_nodes

    target_features: tuple[int, ...] = ()  # target layers whose outputs the drafter reads (EAGLE-style)
    step_prefilled: bool = False  # the engine's current step ran a prefill (set by the engine every step)
    joining: tuple = ()  # requests whose prompt that prefill finished: they decode from the next step (ditto)
    pipelined: bool = False  # steps are queued one step early (``specdec.pipeline``): set before ``lookahead`` is read
    free_chains: bool = False  # ``free_chain`` gives the chain ``propose`` would, at no device cost (n-gram lookup)

    @property
    def node_budget(self) -> int:
        """Most nodes a tree of this step may have: ``budget`` when set, never more than ``max_nodes``."""
        return self.max_nodes if self.budget is None else min(self.budget, self.max_nodes)

    @property
    def lookahead(self) -> int:
        """Positions past a row's last token whose KV slots a step may write (the draft tree region): the
        scheduler keeps them allocated. ``max_nodes`` unless a drafter drafts more nodes than it proposes."""
        return self.max_nodes

    def prefill(self, chunks) -> None:  # noqa: B027 - optional hook, model-free drafters need no KV
        """Write the draft model's KV for prompt chunks (list of PrefillChunk), right after the target's prefill of
        them (which wrote the ``target_features`` outputs into their KV slots: ``KVPool.features``)."""

    def accepted(self, rows: list[Request], results) -> None:  # noqa: B027 - optional hook
        """Called after the verify results of ``rows`` were committed."""

    def forget(self) -> None:  # noqa: B027 - optional hook, most drafters keep nothing across requests
        """Drop what was learned from earlier requests' text (benchmarks call it before each timed run, so a
        repeated prompt is not drafted from its own earlier reply)."""

    def free_chain(self, req: Request, k: int) -> list[int]:
        """The chain of at most ``k`` tokens this drafter would propose for ``req`` now, computed on the host without
        device work (only where ``free_chains``): the budget controller's look at what speculating would commit
        while it decodes plainly (``EpochBudget.watch``)."""
        raise NotImplementedError(f"{type(self).__name__} has no free chains")

    @abstractmethod
    def propose(self, rows: list[Request]) -> Proposal:
        """One tree per row, nodes in level order, at most ``max_nodes`` each."""
