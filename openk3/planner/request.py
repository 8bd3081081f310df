"""PlanRequest: everything a user asks the planner (model, hardware, workload, SLO, what is pinned and what is searched),
validated on construction. Its own module so that the plan (plan.py) and the disaggregation search (disagg.py), which
both take it, do not import each other."""

from __future__ import annotations

from dataclasses import dataclass, field

from openk3.config import ModelConfig
from openk3.planner.agent import AgentTask
from openk3.planner.balance import BalanceParams
from openk3.planner.comm import CommParams
from openk3.planner.energy import PowerParams
from openk3.planner.hardware import System
from openk3.planner.inputs import Balance, Quantisation
from openk3.planner.memory import DEFAULT_FILL, tp_problem
from openk3.planner.perf import Efficiency
from openk3.planner.placement import tp_placement_problem
from openk3.planner.queueing import QueueOptions
from openk3.planner.search import SLO, SearchSpace
from openk3.planner.speculative import SpecDecoding
from openk3.planner.workload import RequestMix


@dataclass(frozen=True)
class PlanRequest:
    config: ModelConfig
    system: System
    context: int
    concurrency: int | None = None  # None: searched (the cheapest batch meeting the SLO)
    prompt: int | None = None
    quant: Quantisation = field(default_factory=Quantisation)
    accelerators: int | None = None  # None: searched up to space.max_accelerators
    tp: int | None = None  # None: searched (divisors of the heads whose groups sit whole inside a scale-up domain)
    balance: Balance | None = None  # None: searched (space.balances)
    redundant_experts: int | None = None  # None: searched (none, or one per rank with EPLB)
    slo: SLO = field(default_factory=SLO)
    efficiency: Efficiency = field(default_factory=Efficiency)
    comm: CommParams = field(default_factory=CommParams)
    balance_params: BalanceParams = field(default_factory=BalanceParams)
    power: PowerParams = field(default_factory=PowerParams)
    fill: float = DEFAULT_FILL
    space: SearchSpace = field(default_factory=SearchSpace)
    requests: RequestMix | None = None  # a workload: rank by $ per request and size the fleet (context/prompt derived from it)
    spec: SpecDecoding | None = None  # speculative decoding of every decode step (speculative.py)
    agent: AgentTask | None = None  # cost per completed agent task on the headline (agent.py)
    queue: QueueOptions = field(default_factory=QueueOptions)  # with --rate: the queueing simulation (queueing.py)
    disaggregate: bool = False  # with a workload: also the best xPyD plan beside the best aggregated one (disagg.py)

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency!r} is invalid: expected >= 1 sequence (or None to search it)")
        if self.accelerators is not None and self.accelerators < 1:
            raise ValueError(f"accelerators={self.accelerators!r} is invalid: expected >= 1")
        if self.tp is not None:
            if self.tp < 1:
                raise ValueError(f"tp={self.tp!r} is invalid: expected >= 1")
            problem = tp_problem(self.config, self.tp)
            if problem:
                raise ValueError(f"{problem} ({self.config.name})")
            if self.accelerators is not None and self.accelerators % self.tp:
                raise ValueError(f"tp={self.tp} is invalid: expected a divisor of accelerators={self.accelerators}")
            # groups that would straddle scale-up domains cannot exist as priced (placement.py); with the size open, the
            # search keeps only sizes where they fit, which for tp > domain is none
            size = self.accelerators if self.accelerators is not None else self.tp
            placement = tp_placement_problem(self.tp, size, self.system)
            if placement:
                raise ValueError(f"tp={self.tp} is invalid: {placement}")
        if self.disaggregate and self.requests is None:
            raise ValueError("disaggregation needs a workload: --input/--output or --requests (and optionally --rate)")

    @property
    def pinned(self) -> bool:
        return any(v is not None for v in (self.accelerators, self.tp, self.balance, self.redundant_experts, self.concurrency))
