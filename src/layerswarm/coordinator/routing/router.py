"""Routes requests through the swarm: the stem here, a plan over the registry's routable nodes, the hops
(star through the executor, or relay chains), the head here; k routes for an ensemble.

The router holds no process machinery: the process (coordinator/process.py) builds it, keeps the
registry current and starts and stops everything; HTTP calls `classify`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from layerswarm.models.checkpoint import Manifest
from layerswarm.models.checkpoint import load_stem_head as load_parts
from layerswarm.models.exits import ExitPolicy
from layerswarm.models.text.tokenizer import PAD_ID

from ..membership.registry import Registry
from ..membership.watch import SwarmWatch
from ..settings import CoordinatorSettings
from .depth import DepthRule, missing_blocks
from .ensemble import EnsembleResult, Route, run_ensemble
from .executor import PathExecutor
from .exits import RouteExit, load_defaults, request_policy
from .members import Member, load_members
from .netorder import NetPlan, plan_from_registry
from .planner import Plan, Policy, plan_path, with_repeats
from .request import ClassifyOptions, Request, check_images, check_options, check_stem_output
from .topology import TopologyChooser, TopologyState
from .trace import DepthError, PathResult
from .wire_choice import WireFormat

log = logging.getLogger(__name__)


@dataclass
class Classification:
    probs: torch.Tensor  # (B, classes)
    path: PathResult  # the first route's
    policy: Policy
    seed: int
    elapsed_ms: float
    ensemble: EnsembleResult
    exit_rule: str | None = None  # the rule a route exited by (None: no route exited early)


class RelayRoutes(Protocol):
    """Relay chains for a route (relay/chains.py: RelayRunner), above routing: handed in, not imported."""

    async def run(
        self, x: torch.Tensor, plan: Plan, request: Request, route_id: str, rng: random.Random
    ) -> PathResult: ...


class RouteObserver(Protocol):
    """Who counts what routes did (metrics.py: CoordinatorMetrics), above routing: handed in."""

    def observe_route(self, path: PathResult) -> None: ...

    def observe(self, result: EnsembleResult, exit_rule: str | None) -> None: ...


class Router:
    def __init__(
        self,
        settings: CoordinatorSettings,
        manifest: Manifest,
        depth_rule: DepthRule,
        wire: WireFormat,
        registry: Registry,
        watch: SwarmWatch,
        executor: PathExecutor,
        relay: RelayRoutes | None = None,
        observer: RouteObserver | None = None,
    ) -> None:
        self.settings = settings
        self.manifest = manifest
        self.config = manifest.config
        self.depth_rule = depth_rule  # readiness and the anytime floor (depth.py)
        self.wire = wire
        self.registry = registry
        self.watch = watch
        self.executor = executor
        self.relay = relay
        self.observer = observer
        self.stem, self.head = load_parts(settings.model_dir, manifest)
        self.members = load_members(settings.model_dir, manifest, self.stem, self.head, settings.family_dirs)
        self.adaptive = load_defaults(settings.model_dir, settings.exit_rule, settings.exit_threshold)
        log.info("adaptive compute defaults: %s", self.adaptive.to_json())
        # Every block index must stay reachable: say so louder, a single lost index means 503s.
        no_spare = depth_rule.min_blocks == depth_rule.depth and not depth_rule.repeats
        level = logging.WARNING if no_spare else logging.INFO
        log.log(level, "how many blocks must answer: %s", depth_rule.describe())
        self.topology = TopologyChooser() if settings.topology == "auto" and relay is not None else None
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stem-head")

    @property
    def default_policy(self) -> Policy:
        if self.settings.default_policy != "auto":
            return Policy(self.settings.default_policy)
        return Policy.SHUFFLE if self.config.shuffle_robust else Policy.SEQUENTIAL

    def depth_ready(self) -> tuple[bool, str]:
        """Whether a request with the defaults can be answered now (enough blocks reachable), and why."""
        depth = self.registry.reachable_depth()
        need = self.depth_rule.min_blocks
        if depth >= need:
            return True, f"{depth} of {self.config.depth} blocks reachable (minimum {need})"
        missing = missing_blocks(self.config.depth, set(self.registry.routable_by_block()))
        if depth > 0 and self.adaptive.repeats:  # what a request with the defaults does: ready as it is
            return True, (
                f"{depth} of {self.config.depth} blocks reachable (no node for block indices {missing}); requests "
                f"run some again to reach the minimum depth {need} (repeats: on by default for this model, where "
                "calibration showed they help)"
            )
        return False, (
            f"only {depth} of {self.config.depth} blocks reachable, minimum depth is {need}: no node for block "
            f"indices {missing}"
        )

    async def classify(self, inputs: torch.Tensor, options: ClassifyOptions) -> Classification:
        """inputs: (B, C, H, W) float32 in [0, 1], or for a text family (B, T) token ids ([PAD]-filled;
        models/text/tokenizer.py). Raises DepthError when too few blocks can run, and InvalidRequest
        for options or inputs no node could serve (ExitRuleError: an invalid exit rule or threshold)."""
        started = time.monotonic()
        check_options(options, self.config)  # the caller's mistakes must never count against a node
        check_images(inputs, self.config)
        await self.watch.wait_first_round(self.settings.request_timeout_s / 2)
        exit_policy = request_policy(self.adaptive, options.exit_rule, options.exit_threshold, options.exit_confidence)
        x = await self._run_local(self.stem, inputs)
        check_stem_output(x, self.wire.dtype)
        policy = options.policy or self.default_policy
        request = Request(
            options=options,
            id=uuid.uuid4().hex[:16],
            inputs=inputs,
            x=x,
            policy=policy,
            seed=options.seed if options.seed is not None else random.SystemRandom().randrange(2**31),
            min_blocks=options.min_blocks if options.min_blocks is not None else self.depth_rule.min_blocks,
            anytime_min_blocks=self.depth_rule.anytime_min_blocks,
            shuffle_robust=self.config.shuffle_robust and policy is not Policy.SEQUENTIAL,
            deadline=started + self.settings.request_timeout_s,
            anytime_deadline=None if options.deadline_ms is None else started + options.deadline_ms / 1e3,
            key_mask=inputs != PAD_ID if self.config.is_text else None,
        )

        async def route(index: int) -> Route:
            return await self._route(request, index, exit_policy)

        unsure_below = options.ensemble_confidence or self.adaptive.ensemble_confidence
        result = await run_ensemble(route, options.ensemble, options.ensemble_mode, unsure_below)
        exited = next((r for r in result.routes if r.path.exited_early), None)
        rule = exit_policy.rule.value if exited is not None and exit_policy is not None else None
        if self.observer is not None:
            self.observer.observe(result, rule)
        elapsed_ms = (time.monotonic() - started) * 1e3
        return Classification(
            result.logits.softmax(-1), result.routes[0].path, policy, request.seed, elapsed_ms, result, rule
        )

    async def _route(self, request: Request, index: int, exit_policy: ExitPolicy | None) -> Route:
        """One path through the swarm: route i takes its own random order and nodes (seed + i), and in
        ensembles over members member i's stem, nodes (preferred) and head."""
        rng = random.Random(request.seed + index)
        member = self._member(request.options, index)
        own = member is self.members[0]
        x = request.x if own else await self._run_local(member.stem, request.inputs)

        async def head(activations: torch.Tensor) -> torch.Tensor:
            return await (self.head_logits(activations) if own else self._run_local(member.head, activations))

        plan = plan_path(
            request.policy,
            self.registry.routable_by_block(),
            self.config.depth,
            rng,
            request.options.max_blocks,
            preferred_model=member.model_id,
            keep_to_model=self._over_members(request.options),
        )
        topology = self._topology(len(plan.steps), request, exit_policy)
        netplan = self._network_plan(plan, x, topology) if request.policy is Policy.NETWORK else None
        if netplan is not None:
            plan = Plan(netplan.plan.steps, plan.unreachable)
        repeats = request.options.repeats if request.options.repeats is not None else self.adaptive.repeats
        if repeats:
            plan = with_repeats(plan, request.min_blocks, rng, shuffle=request.policy is not Policy.SEQUENTIAL)
        if len(plan.steps) < request.min_blocks:  # not ready: refused before any node works on it
            raise self._too_few(plan, request)
        route_id = f"{request.id}-{index}" if index else request.id
        started = time.monotonic()
        if topology == "relay" and self.relay is not None:
            path = await self.relay.run(x, plan, request, route_id, rng)  # no per-hop exit inside a chain
        else:
            floor = self.adaptive.exit_min_blocks
            early_exit = RouteExit(exit_policy, head, floor) if exit_policy is not None else None
            path = await self.executor.run(x, plan, request, route_id, rng, early_exit, head=head)
        if self.topology is not None:
            self.topology.observe(topology, (time.monotonic() - started) * 1e3, path.depth)
        if netplan is not None:
            path.network = {
                "predicted_ms": round(netplan.predicted_ms, 3),
                "actual_ms": round((time.monotonic() - started) * 1e3, 3),
                "order": [s.block for s in plan.steps],
                "nodes": [s.candidates[0].address for s in plan.steps],
            }
        if self.observer is not None:
            self.observer.observe_route(path)
        return Route(index, path, await head(path.activations), member.model_id)

    def _too_few(self, plan: Plan, request: Request) -> DepthError:
        """Why a planned path cannot reach the request's minimum depth: the indices no node serves."""
        if not plan.unreachable:  # every index is reachable: the request's own max_blocks cut the path
            return DepthError(f"max_blocks {len(plan.steps)} is below the minimum depth {request.min_blocks}")
        return DepthError(
            f"only {self.config.depth - len(plan.unreachable)} of {self.config.depth} block indices reachable "
            f"(minimum {request.min_blocks}): no node serves block indices {plan.unreachable}",
            plan.unreachable,
        )

    def _over_members(self, options: ClassifyOptions) -> bool:
        return options.ensemble > 1 and options.ensemble_over == "members" and len(self.members) > 1

    def _member(self, options: ClassifyOptions, index: int) -> Member:
        """Whose stem and head route `index` uses: ours, or in ensembles over members the i-th member
        (whose nodes the route then keeps to, where they are up)."""
        return self.members[index % len(self.members)] if self._over_members(options) else self.members[0]

    def _topology(self, steps: int, request: Request, exit_policy: ExitPolicy | None) -> str:
        """star or relay for this route: the setting, or under `auto` the measured faster one. auto keeps
        to star where a chain would drop what the request asked for: a per-hop exit or an anytime deadline."""
        if self.relay is None or steps < 2 or self.config.is_text:  # relays do not carry token masks yet
            return "star"
        if self.topology is None:
            return "relay"
        if exit_policy is not None or request.anytime_deadline is not None:
            return "star"
        return self.topology.choose()

    def topology_view(self) -> TopologyState:
        """What the page shows: the setting, whether relay can be used here (and why not), and under
        auto each topology's measured time per hop."""
        setting = self.settings.topology
        if self.config.is_text:
            why = "text family: star (relay chains do not carry token masks yet)"
        elif setting != "star" and self.relay is None:
            why = "no swarm token (--token-file): star only; relay chains are MACed with it"
        else:
            why = {
                "auto": "per request, whichever has been faster per hop (star for exits and deadlines)",
                "relay": "every route a relay chain",
                "star": "every hop through the coordinator",
            }[setting]
        measured = self.topology.to_json() if self.topology is not None else None
        return {"setting": setting, "relay_available": self.relay is not None, "why": why, "measured": measured}

    def _network_plan(self, plan: Plan, x: torch.Tensor, topology: str) -> NetPlan:
        """The planned blocks, ordered (robust families) and placed to minimise expected time."""
        nbytes = x.numel() * torch.empty(0, dtype=self.wire.dtype).element_size()
        return plan_from_registry(
            self.registry.routable_by_block(),
            [s.block for s in plan.steps],
            self.registry.links,
            nbytes,
            keep_order=not self.config.shuffle_robust,
            relay=topology == "relay",
        )

    async def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Our own head on the path's activations (tests and the adaptive bench wrap it)."""
        return await self._run_local(self.head, x)

    async def _run_local(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        def compute() -> torch.Tensor:
            with torch.inference_mode():
                return module(x)

        return await asyncio.get_running_loop().run_in_executor(self._compute, compute)

    async def close(self) -> None:
        """Cancel hedge losers still running and stop the stem-head thread (the process is stopping)."""
        await self.executor.close()
        self._compute.shutdown(wait=False, cancel_futures=True)
