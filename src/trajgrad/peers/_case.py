"""The record types of :mod:`trajgrad.peers`: one peer function to check (:class:`PeerCase`) and its
classified outcome (:class:`CaseResult`); the package re-exports both."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple


@dataclass(frozen=True)
class PeerCase:
    peer: str
    function: str
    make: Callable[[], Callable]
    recipe: str
    options: Dict[str, Any] = field(default_factory=dict)
    kind: str = "policy"            # "policy" | "advantage" | "token_advantage" | "kl" | "cov_topk" | "cov_random" | "pairwise"
                                    # | "token_baseline" | "critic"
    include_kl: bool = False
    denominator: Optional[str] = None   # "rows": trajgrad called with denominator = number of rows (empty ones too)
    notes: Tuple[str, ...] = ()
    # checks that the convention itself makes fail (e.g. ``padding`` for a loss averaged over every row)
    convention_checks: Tuple[str, ...] = ()
    # trajgrad's side when the recipe's registry entry cannot take the peer's input (response lengths,
    # a baseline reward): ``ours(...)`` with the adapter's arguments, named by ``ours_name`` in the result
    ours: Optional[Callable] = None
    ours_name: str = ""
    # set where trajgrad has no counterpart: the case is expected to differ, and this line says why
    no_counterpart: str = ""
    tol: float = 1e-9                   # the value tolerance (raised, with a note, for a peer computing in float32)
    observations: bool = False          # token baselines: responses with observation tokens inside (multi-turn)


@dataclass
class CaseResult:
    case: PeerCase
    status: str
    worst: float
    failed_objective: List[str]
    conventions: List[str]
    table: str
    error: str = ""
