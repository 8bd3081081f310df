"""The `serve.run` entry: an Application of N engine replicas and the front end, for `openk3 serve` flags read by the
launch layer (a ReplicaLaunch: openk3.launch.replicas.replica_application builds the Application from argv).

    from ray import serve
    from openk3.launch.replicas import replica_application
    from openk3.scale.deploy import ScaleConfig
    serve.run(replica_application(["--model", "tiny", "--enable-prefix-caching"], ScaleConfig(replicas=2)), name="openk3")

`router="prefix"` routes by cached prefix (router.py) and needs the replicas' prefix caching; `router="pow2"` is Ray's
default power-of-two-choices router (the baseline the benchmark compares with; router.py adds report targeting). `prefill_replicas=P` adds a pool of P
prefill replicas (prefill/decode disaggregation, frontend.py): the `replicas` then decode, every completion and chat
prompt is computed on a prefill replica first and handed over with its KDA state and MLA latents. Both pools run the
same engine flags and the same router, and need prefix caching (the hand-off lands in the decode engine's prefix cache).
`prefix_pull` (prefix router only; None: on where it can be, i.e. one-rank replicas and no prefill pool) lets a replica
that lacks a prefix another replica holds pull it instead of computing it (scale/prefix_pull.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from openk3.checks import check_choice, check_int, check_number
from openk3.scale.frontend import Frontend
from openk3.scale.health_board import ProbeConfig
from openk3.scale.replica import EngineReplica
from openk3.scale.replica_launch import ReplicaLaunch
from openk3.scale.router import PrefixAffinityRouter, TargetedPowerOfTwoRouter

ROUTERS = ("prefix", "pow2")
REPLICA_DEPLOYMENT = "EngineReplica"
PREFILL_DEPLOYMENT = "PrefillReplica"


@dataclass(frozen=True)
class ScaleConfig:
    replicas: int  # the engine replicas; with prefill_replicas > 0, the decode pool
    prefill_replicas: int = 0  # > 0: a pool of prefill replicas in front of the decode pool (disaggregation)
    router: str = "prefix"
    replica_cpus: float = 1.0  # Ray CPUs reserved per rank of a replica (its engine thread and torch's)
    max_ongoing_requests: int = 512  # per replica; past it Ray queues at the front end, the engine's own admission is the limit
    max_imbalance: int = 4  # prefix router: in-flight requests a match may cost over the least loaded replica
    health_period_s: float = 0.5  # the front end probes every replica's /health this often (health_board.py)
    health_timeout_s: float = 2.0  # a replica that does not answer its probe in this long is unhealthy
    app_name: str = "openk3"
    prefix_pull: bool | None = None  # cross-replica prefix pulls (prefix router); None: on wherever the replicas allow it

    def __post_init__(self) -> None:
        check_int("ScaleConfig", "replicas", self.replicas, low=1)
        check_int("ScaleConfig", "prefill_replicas", self.prefill_replicas, low=0)
        check_choice("ScaleConfig", "router", self.router, ROUTERS)
        check_number("ScaleConfig", "replica_cpus", self.replica_cpus, low=0)
        check_int("ScaleConfig", "max_ongoing_requests", self.max_ongoing_requests, low=1)
        check_int("ScaleConfig", "max_imbalance", self.max_imbalance, low=1)
        ProbeConfig(self.health_period_s, self.health_timeout_s)  # its checks, under its own names


def check_combination(launch: ReplicaLaunch, config: ScaleConfig) -> int:
    """The replicas' prefix match unit; a flag combination replicas cannot serve is a ValueError naming it."""
    engine, parallel = launch.engine, launch.parallel
    engine.check_ops_on_device()  # --ops here, before any replica loads weights (each replica checks again as it prepares its model)
    if parallel.export_eplb_stats is not None:
        raise ValueError("--export-eplb-stats with --replicas: every replica would write its own counts to the one file; export from one `openk3 serve`")
    if config.router == "prefix" and not engine.enable_prefix_caching:
        raise ValueError("--replica-router prefix routes by cached prefix: it needs --enable-prefix-caching (or use --replica-router pow2)")
    if config.prefill_replicas and parallel.world_size > 1:
        # the hand-off reads and writes one engine's prefix cache; a multi-rank engine's is spread over its ranks
        raise ValueError(f"--prefill-replicas with multi-rank replicas (--tp/--ep/--dp, {parallel.world_size} ranks) is not supported: use one-rank replicas")
    if config.prefill_replicas and not engine.enable_prefix_caching:
        raise ValueError("--prefill-replicas hands each prompt to a decode replica's prefix cache: it needs --enable-prefix-caching")
    return engine.prefix_match_unit


def pulls_on(launch: ReplicaLaunch, config: ScaleConfig) -> bool:
    """Whether replicas pull prefixes from each other; `prefix_pull=True` where they cannot is a ValueError naming why."""
    why = None
    if config.router != "prefix":
        why = "it needs --replica-router prefix (the router hints where a prefix is)"
    elif config.prefill_replicas:
        why = "with --prefill-replicas every prompt is handed over by a prefill replica already"
    elif launch.parallel.world_size > 1:
        why = f"a prefix record holds one rank's cache, and these replicas have {launch.parallel.world_size} ranks"
    if why is not None and config.prefix_pull:
        raise ValueError(f"--replica-prefix-pull on: {why}")
    return why is None and config.prefix_pull is not False


def replica_resources(launch: ReplicaLaunch, config: ScaleConfig) -> dict[str, float]:
    """Ray's actor options for one replica: `replica_cpus` per rank and, on CUDA, one GPU per rank. A replica of several
    ranks spawns them on its own node, and they see the GPUs Ray gives the replica's actor (CUDA_VISIBLE_DEVICES), so
    the actor itself asks for every rank's share: Ray places it only on a node where all of them are free."""
    ranks = launch.parallel.world_size
    options = {"num_cpus": config.replica_cpus * ranks}
    if launch.engine.device.startswith("cuda"):
        options["num_gpus"] = float(ranks)
    return options


def application(launch: ReplicaLaunch, config: ScaleConfig) -> Application:
    """The replicas and their front end; `launch`: the `openk3 serve` flags every replica runs, as the launch layer read
    them (openk3.launch.replicas.replica_application builds one from argv)."""
    match_unit = check_combination(launch, config)
    pull = pulls_on(launch, config)
    resources = replica_resources(launch, config)
    if config.router == "prefix":
        kwargs = {"max_imbalance": config.max_imbalance, "pull_min_units": 1 if pull else None}
        router = RequestRouterConfig(request_router_class=PrefixAffinityRouter, request_router_kwargs=kwargs)  # type: ignore[arg-type]
    else:
        router = RequestRouterConfig(request_router_class=TargetedPowerOfTwoRouter)  # type: ignore[arg-type]

    def pool(name: str, size: int) -> Any:
        deployment: Any = serve.deployment(
            EngineReplica,
            name=name,
            num_replicas=size,
            max_ongoing_requests=config.max_ongoing_requests,
            ray_actor_options=resources,
            request_router_config=router,
            health_check_period_s=2.0,
            health_check_timeout_s=30.0,
        )
        return deployment.bind(launch)

    ingress: Any = serve.ingress()(Frontend)  # the deferred-app form: Frontend.__serve_build_asgi_app__ builds it
    front: Any = serve.deployment(ingress, name="Frontend", num_replicas=1, ray_actor_options={"num_cpus": 0})
    decode = pool(REPLICA_DEPLOYMENT, config.replicas)
    probe = ProbeConfig(config.health_period_s, config.health_timeout_s)
    if not config.prefill_replicas:
        return front.bind(
            decode, launch.serve_args, config.app_name, REPLICA_DEPLOYMENT, match_unit, probe=probe, pool_sizes=(config.replicas, 0), prefix_pull=pull
        )
    prefill = pool(PREFILL_DEPLOYMENT, config.prefill_replicas)
    sizes = (config.replicas, config.prefill_replicas)
    return front.bind(decode, launch.serve_args, config.app_name, REPLICA_DEPLOYMENT, match_unit, prefill, PREFILL_DEPLOYMENT, probe=probe, pool_sizes=sizes)
