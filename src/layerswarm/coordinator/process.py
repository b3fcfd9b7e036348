"""The coordinator: owns stem and head, discovers nodes, plans and executes paths."""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from layerswarm.models.checkpoint import load_stem_head as load_parts
from layerswarm.models.checkpoint import read_manifest
from layerswarm.models.exits import ExitPolicy
from layerswarm.models.text.tokenizer import PAD_ID
from layerswarm.wire import codec
from layerswarm.wire.auth import derive_key

from .assembly import default_min_blocks, family_spec, log_node_event, make_verifier, wire_choice
from .membership.clients import ClientPool
from .membership.discovery import DnsDiscovery, MdnsDiscovery
from .membership.health import REMEMBERED, HealthMonitor
from .membership.peer_memory import load_peers, save_peers
from .membership.periodic import Periodic
from .membership.records import NodeEvent, NodeState
from .membership.registry import Registry
from .metrics import CoordinatorMetrics
from .relay.chains import RelayRunner
from .relay.handbacks import HandbackReferee, forward_probe
from .routing.ensemble import EnsembleResult, Route, run_ensemble
from .routing.executor import PathExecutor
from .routing.exits import RouteExit, load_defaults, request_policy
from .routing.members import Member, load_members
from .routing.netorder import NetPlan, plan_from_registry
from .routing.planner import Plan, Policy, plan_path, with_repeats
from .routing.request import check_images, check_options, check_stem_output
from .routing.topology import TopologyChooser
from .routing.trace import ExecOptions, PathResult
from .settings import CoordinatorSettings

log = logging.getLogger(__name__)
MDNS_QUIET_S = 0.3  # the first round waits until no advert came for this long


@dataclass
class ClassifyOptions:
    top_k: int = 5
    policy: Policy | None = None  # None: the family's default
    seed: int | None = None
    min_blocks: int | None = None
    max_blocks: int | None = None
    exit_confidence: float | None = None  # early exit once the head is this sure (after min_blocks)
    exit_rule: str | None = None  # confidence | entropy | patience | none; None: the coordinator's default
    exit_threshold: float | None = None  # None: the calibrated threshold of the rule
    deadline_ms: float | None = None  # anytime: answer with what ran once the next hop would be late
    ensemble: int = 1  # routes whose logits are averaged
    ensemble_mode: str = "adaptive"  # adaptive: another route only while unsure; parallel: all at once
    ensemble_confidence: float | None = None  # adaptive: unsure below this; None: the calibrated value
    ensemble_over: str = "members"  # members: route i runs member i (stem, nodes, head); orders: one model
    repeats: bool | None = None  # None: where calibration showed repeated blocks help
    token_depth: torch.Tensor | None = None  # text: (B, T) hops per token before it freezes (None: all)


@dataclass
class Classification:
    probs: torch.Tensor  # (B, classes)
    path: PathResult  # the first route's
    policy: Policy
    seed: int
    elapsed_ms: float
    ensemble: EnsembleResult
    exit_rule: str | None = None  # the rule a route exited by (None: no route exited early)


@dataclass
class _RouteSetup:
    """What every route of one request shares."""

    images: torch.Tensor  # the request's input, for other members' stems
    x: torch.Tensor  # our own stem's output
    policy: Policy
    seed: int
    opts: ClassifyOptions
    min_blocks: int
    deadline: float
    request_id: str
    anytime_deadline: float | None  # the caller's budget: no hop starts past it once min depth ran
    key_mask: torch.Tensor | None = None  # text: real tokens of the ids


class Coordinator:
    def __init__(self, settings: CoordinatorSettings) -> None:
        self.settings = settings
        self.manifest = read_manifest(settings.model_dir)
        self.config = self.manifest.config
        self.stem, self.head = load_parts(settings.model_dir, self.manifest)
        self.members = load_members(settings.model_dir, self.manifest, self.stem, self.head, settings.family_dirs)
        self.registry = Registry(
            family_spec(settings),
            settings.eject_after,
            settings.quarantine_s,
            on_change=self._on_node_event,
            conviction_cooldown_s=settings.conviction_cooldown_s,
        )
        self.pool = ClientPool(transport=settings.transport, security=settings.security)
        self.min_blocks = default_min_blocks(settings, self.manifest)
        self.verifier = make_verifier(settings)
        if self.verifier is not None:
            self.verifier.quarantine_referee = self.registry.quarantine
        self.metrics = CoordinatorMetrics(self.registry, self.verifier)  # before any node event is counted
        self.executor = PathExecutor(self.registry, self.pool, self.verifier)
        self.monitor = HealthMonitor(self.registry, self.pool, settings.health_interval_s, settings.health_timeout_s)
        probe = forward_probe(self.registry, self.pool, settings.hop_timeout_s)
        self.handbacks = HandbackReferee(
            self.registry, probe, 2 * settings.hop_timeout_s, self.metrics.observe_handback
        )
        token = settings.security.token
        self.relay = (
            RelayRunner(self.registry, self.pool, self.executor, derive_key(token), self.verifier, self.handbacks)
            if settings.topology in ("relay", "auto") and token
            else None
        )
        self.topology = TopologyChooser() if settings.topology == "auto" and self.relay is not None else None
        verify = self.monitor.verify_soon
        self.discovery = MdnsDiscovery(self.registry, settings.mdns_interfaces, verify) if settings.mdns else None
        self.dns = DnsDiscovery(self.registry, settings.peer_dns, verify=verify) if settings.peer_dns else None
        self._first_round = asyncio.Event()  # set once the first discovery and health round is done
        self._first_round_task: asyncio.Task[None] | None = None
        self._saved_peers: set[str] | None = None
        self._memory = Periodic("peer-memory", 2.0, self._remember_peers)
        self.adaptive = load_defaults(settings.model_dir, settings.exit_rule, settings.exit_threshold)
        log.info("adaptive compute defaults: %s", self.adaptive.to_json())
        auto_wire = settings.wire_dtype == "auto"
        self.wire_dtype = codec.dtype_by_name("fp16" if auto_wire else settings.wire_dtype)
        self.wire_choice = wire_choice(self.config.num_tokens, self.config.dim) if auto_wire else None
        self.frozen_dtype = None if settings.frozen_dtype == "wire" else codec.dtype_by_name(settings.frozen_dtype)
        tokens = None if self.config.is_text else self.config.num_tokens  # text: any T up to the maximum
        self.spec = codec.TensorSpec((None, tokens, self.config.dim), max_batch=settings.max_batch)
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stem-head")
        self._requests_open = 0  # changed only by begin_request / end_request
        for peer in settings.peers:
            self.registry.add_candidate(peer, "static")

    def _on_node_event(self, event: NodeEvent) -> None:
        log_node_event(event)
        if event.old is not event.new:  # not a convicted node refused again (it stays where it was)
            self.metrics.node_transitions.labels(event.new.value if event.new else "forgotten").inc()
        if event.new is None and self.verifier is not None:  # it left: its per-node state goes too
            self.verifier.forget(event.address)

    @property
    def in_flight(self) -> int:
        """Requests admitted and not answered yet (the HTTP layer answers 429 past the limit)."""
        return self._requests_open

    def begin_request(self) -> None:
        self._requests_open += 1

    def end_request(self) -> None:
        self._requests_open -= 1

    @property
    def shuffle_robust(self) -> bool:
        return self.config.shuffle_robust

    @property
    def default_policy(self) -> Policy:
        if self.settings.default_policy != "auto":
            return Policy(self.settings.default_policy)
        return Policy.SHUFFLE if self.shuffle_robust else Policy.SEQUENTIAL

    async def start(self) -> None:
        """Look where the nodes were (remembered, static, DNS peers), start mDNS, and finish the first
        round in the background: until then /readyz says so and classify waits instead of a 503."""
        started = time.monotonic()
        if self.settings.state_file is not None:
            for peer in load_peers(self.settings.state_file, self.registry.family.family_id):
                self.registry.add_candidate(peer, REMEMBERED)
        if self.discovery is not None:
            await self.discovery.start()
        if self.dns is not None:
            await self.dns.start()
        await self.monitor.check_all()
        self.monitor.start()
        if self.settings.state_file is not None:
            self._memory.start()
        self._first_round_task = asyncio.create_task(self._finish_first_round(started), name="first-round")

    async def _finish_first_round(self, started: float) -> None:
        """mDNS answers come in over the first second or so: wait for them to go quiet and for one
        check of each node, bounded by `startup_wait_s` (sooner once every block is reachable)."""
        deadline = started + self.settings.startup_wait_s
        settle_until = started + (self.settings.mdns_settle_s if self.discovery is not None else 0.0)
        while time.monotonic() < deadline:
            now = time.monotonic()
            all_checked = all(r.checked for r in self.registry.nodes.values())
            quiet = self.discovery is None or now - self.discovery.last_heard >= MDNS_QUIET_S
            if all_checked and self.registry.reachable_depth() >= self.config.depth:
                break
            if all_checked and quiet and now >= settle_until:
                break
            await asyncio.sleep(0.05)
        self._first_round.set()
        log.info(
            "first discovery round done in %.2f s: %d of %d blocks reachable",
            time.monotonic() - started,
            self.registry.reachable_depth(),
            self.config.depth,
        )

    async def _remember_peers(self) -> None:
        assert self.settings.state_file is not None
        peers = {r.address for r in self.registry.nodes.values() if r.proven and r.state is not NodeState.IGNORED}
        if peers == self._saved_peers:
            return
        self._saved_peers = peers  # tried once per change: an unwritable state dir warns, never spams
        try:
            await asyncio.to_thread(save_peers, self.settings.state_file, self.registry.family.family_id, list(peers))
        except OSError as exc:
            log.warning(
                "cannot write peer state file %s: %s (restarts will not remember peers)", self.settings.state_file, exc
            )

    async def wait_first_round(self, timeout_s: float) -> None:
        """Wait (bounded) until the first discovery round is done: answering before it would be a 503
        for a swarm that is there."""
        try:
            await asyncio.wait_for(self._first_round.wait(), max(0.0, timeout_s))
        except TimeoutError:
            log.warning("first discovery round still running after %.1f s: answering anyway", timeout_s)

    async def stop(self) -> None:
        if self._first_round_task is not None:
            self._first_round_task.cancel()
            await asyncio.gather(self._first_round_task, return_exceptions=True)
        await self._memory.stop()
        if self.settings.state_file is not None:
            await self._memory.run_once()
        if self.discovery is not None:  # discovery first: it asks the monitor for checks
            await self.discovery.stop()
        if self.dns is not None:
            await self.dns.stop()
        await self.handbacks.close()
        await self.monitor.stop()
        await self.executor.close()
        await self.pool.close()
        self._compute.shutdown(wait=False, cancel_futures=True)
        if self.verifier is not None:
            self.verifier.close()

    def ready(self) -> tuple[bool, str]:
        if not self._first_round.is_set():
            return False, "starting: the first discovery and health round is not complete"
        depth = self.registry.reachable_depth()
        need = self.min_blocks
        if depth >= need:
            return True, f"{depth} of {self.config.depth} blocks reachable (minimum {need})"
        if depth > 0 and self.adaptive.repeats:  # what a request with the defaults does: ready as it is
            return True, (
                f"{depth} of {self.config.depth} blocks reachable; requests run some again to reach the minimum "
                f"depth {need} (repeats: on by default for this model, where calibration showed they help)"
            )
        return False, f"only {depth} of {self.config.depth} blocks reachable, minimum depth is {need}"

    async def classify(self, images: torch.Tensor, opts: ClassifyOptions) -> Classification:
        """images: (B, C, H, W) float32 in [0, 1], or for a text family (B, T) token ids ([PAD]-filled;
        models/text/tokenizer.py). Raises DepthError when too few blocks can run, InvalidRequest
        for options or images no node could serve, and ValueError for an invalid exit rule or threshold."""
        started = time.monotonic()
        check_options(opts, self.config)  # the caller's mistakes must never count against a node
        check_images(images, self.config)
        await self.wait_first_round(self.settings.request_timeout_s / 2)
        exit_policy = request_policy(self.adaptive, opts.exit_rule, opts.exit_threshold, opts.exit_confidence)
        budget_s = self.settings.request_timeout_s
        x = await self._run_local(self.stem, images)
        check_stem_output(x, self.wire_dtype)
        setup = _RouteSetup(
            images=images,
            x=x,
            policy=opts.policy or self.default_policy,
            seed=opts.seed if opts.seed is not None else random.SystemRandom().randrange(2**31),
            opts=opts,
            min_blocks=opts.min_blocks if opts.min_blocks is not None else self.min_blocks,
            deadline=started + budget_s,
            request_id=uuid.uuid4().hex[:16],
            anytime_deadline=None if opts.deadline_ms is None else started + opts.deadline_ms / 1e3,
            key_mask=images != PAD_ID if self.config.is_text else None,
        )

        async def route(index: int) -> Route:
            return await self._route(setup, index, exit_policy)

        unsure_below = opts.ensemble_confidence or self.adaptive.ensemble_confidence
        result = await run_ensemble(route, opts.ensemble, opts.ensemble_mode, unsure_below)
        first = result.routes[0].path
        exited = next((r for r in result.routes if r.path.exited_early), None)
        rule = exit_policy.rule.value if exited is not None and exit_policy is not None else None
        self.metrics.observe(result, rule)
        return Classification(
            result.logits.softmax(-1),
            first,
            setup.policy,
            setup.seed,
            (time.monotonic() - started) * 1e3,
            result,
            rule,
        )

    async def _route(self, setup: _RouteSetup, index: int, exit_policy: ExitPolicy | None) -> Route:
        """One path through the swarm: route i takes its own random order and nodes (seed + i), and in
        ensembles over members member i's stem, nodes (preferred) and head."""
        rng = random.Random(setup.seed + index)
        member = self._member(setup.opts, index)
        own = member is self.members[0]
        x = setup.x if own else await self._run_local(member.stem, setup.images)

        async def head(activations: torch.Tensor) -> torch.Tensor:
            return await (self._head_logits(activations) if own else self._run_local(member.head, activations))

        plan = plan_path(
            setup.policy,
            self.registry.routable_by_block(),
            self.config.depth,
            rng,
            setup.opts.max_blocks,
            preferred_model=member.model_id,
            keep_to_model=self._over_members(setup.opts),
        )
        topology = self._topology(len(plan.steps))
        netplan = self._network_plan(plan, x, topology) if setup.policy is Policy.NETWORK else None
        if netplan is not None:
            plan = Plan(netplan.plan.steps, plan.unreachable)
        repeats = setup.opts.repeats if setup.opts.repeats is not None else self.adaptive.repeats
        if repeats:
            plan = with_repeats(plan, setup.min_blocks, rng, shuffle=setup.policy is not Policy.SEQUENTIAL)
        early_exit = RouteExit(exit_policy, head) if exit_policy is not None else None
        exec_opts = ExecOptions(
            hop_timeout_s=self.settings.hop_timeout_s,
            deadline=setup.deadline,
            min_blocks=setup.min_blocks,
            shuffle_robust=self.shuffle_robust and setup.policy is not Policy.SEQUENTIAL,
            wire_dtype=self.wire_dtype,
            wire_choice=self.wire_choice,
            spec=self.spec,
            request_id=f"{setup.request_id}-{index}" if index else setup.request_id,
            early_exit=early_exit,
            anytime_deadline=setup.anytime_deadline,
            hedge_quantile=self.settings.hedge_quantile,
            hedge_min_ms=self.settings.hedge_min_ms,
            key_mask=setup.key_mask,
            token_depth=setup.opts.token_depth,
            frozen_dtype=self.frozen_dtype,
        )
        started = time.monotonic()
        if topology == "relay" and self.relay is not None:
            path = await self.relay.run(x, plan, exec_opts, rng)  # no per-hop exit inside a chain
        else:
            path = await self.executor.run(x, plan, exec_opts, rng)
        if self.topology is not None:
            self.topology.observe(topology, (time.monotonic() - started) * 1e3, path.depth)
        if netplan is not None:
            path.network = {
                "predicted_ms": round(netplan.predicted_ms, 3),
                "actual_ms": round((time.monotonic() - started) * 1e3, 3),
                "order": [s.block for s in plan.steps],
                "nodes": [s.candidates[0].address for s in plan.steps],
            }
        for hop in (*path.hops, *path.discarded):
            self.metrics.hops.labels(hop.outcome).inc()
        self.metrics.observe_chains(path)
        return Route(index, path, await head(path.activations), member.model_id)

    def _over_members(self, opts: ClassifyOptions) -> bool:
        return opts.ensemble > 1 and opts.ensemble_over == "members" and len(self.members) > 1

    def _member(self, opts: ClassifyOptions, index: int) -> Member:
        """Whose stem and head route `index` uses: ours, or in ensembles over members the i-th member
        (whose nodes the route then keeps to, where they are up)."""
        return self.members[index % len(self.members)] if self._over_members(opts) else self.members[0]

    def _topology(self, steps: int) -> str:
        """star or relay for this route: the setting, or under `auto` the measured faster one."""
        if self.relay is None or steps < 2 or self.config.is_text:  # relays do not carry token masks yet
            return "star"
        return self.topology.choose() if self.topology is not None else "relay"

    def _network_plan(self, plan: Plan, x: torch.Tensor, topology: str) -> NetPlan:
        """The planned blocks, ordered (robust families) and placed to minimise expected time."""
        nbytes = x.numel() * torch.empty(0, dtype=self.wire_dtype).element_size()
        return plan_from_registry(
            self.registry.routable_by_block(),
            [s.block for s in plan.steps],
            self.registry.links,
            nbytes,
            keep_order=not self.shuffle_robust,
            relay=topology == "relay",
        )

    async def _head_logits(self, x: torch.Tensor) -> torch.Tensor:
        return await self._run_local(self.head, x)

    async def _run_local(self, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        def compute() -> torch.Tensor:
            with torch.inference_mode():
                return module(x)

        return await asyncio.get_running_loop().run_in_executor(self._compute, compute)
