"""The request router on Ray Serve's request-router API: PrefixAffinityPolicy (routing.py) choosing
among the replica deployment's replicas, for requests the ingress sends with their routing hints.

Ray Serve builds one router per handle, in the process that holds the handle (the ingress), and asks
it for ranked replicas; the first rank is the policy's choice and the rest follow by load, so that a
full replica (max_ongoing_requests) falls through to the next. `on_request_routed` and
`on_request_completed` keep the policy's token counts exact for this router's own requests. A request
pinned to one replica (an admin call the ingress sends to every replica) goes there and nowhere else."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from tokenmill.fleet.metrics import FleetMetrics
from tokenmill.fleet.routing import PIN_REPLICA, ROLE, Decision, PrefixAffinityPolicy, RoutingHints

logger = logging.getLogger(__name__)


class LLMRequestRouter(RequestRouter):
    """Prefix affinity within a load slack, else the least-loaded replica (in tokens)."""

    # Ray probes the chosen replica's queue length before sending; a replica whose one core is busy
    # with a prefill can miss Ray's 0.1 s deadline, which would send the request to the next rank and
    # lose the prefix; waiting up to a second for the answer costs less than prefilling it again.
    queue_len_response_deadline_s = 1.0
    max_queue_len_response_deadline_s = 2.0

    def initialize_state(self, slack_tokens: int = 4096, model_name: str = "", role: str = "both", **_: Any) -> None:
        self.role = role  # the kv_role of this deployment's replicas
        self.policy = PrefixAffinityPolicy(slack_tokens)
        self.metrics = FleetMetrics.for_model(model_name)
        self._decisions: dict[str, Decision] = {}  # internal request id -> the policy's choice
        self._known: set[str] = set()
        self.metrics.stats_sources.append(self.replica_stats)  # for the ingress's /metrics

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        pinned = _pinned_replicas(candidate_replicas, pending_request)
        if pinned is not None:
            return pinned
        self._forget_gone_replicas()
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        reported = {name: int(r.routing_stats.get("load_tokens", 0)) for name, r in by_name.items()}
        hints = _hints(pending_request)
        decision = self.policy.choose(list(by_name), hints, reported)
        if pending_request is not None:
            self._decisions[pending_request.metadata.internal_request_id] = decision
        rest = sorted((n for n in by_name if n != decision.replica), key=lambda n: self.policy.load(n, reported))
        return [[by_name[decision.replica]], [by_name[n] for n in rest]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        if _pin(pending_request) is not None:
            return  # an admin call: no load to count, no prefix to remember
        request_id = pending_request.metadata.internal_request_id
        decision = self._decisions.pop(request_id, None)
        replica = replica_id.unique_id
        self.metrics.decided(decision is not None and decision.affinity and decision.replica == replica)
        self.policy.on_routed(request_id, replica, _hints(pending_request))
        self.metrics.replica_load.labels(self.metrics.model_name, replica).set(self.policy.load(replica, {}))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._decisions.pop(internal_request_id, None)
        self.policy.on_completed(internal_request_id)
        replica = replica_id.unique_id
        self.metrics.replica_load.labels(self.metrics.model_name, replica).set(self.policy.load(replica, {}))

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        """Each live replica's last routing stats (its load and metrics text) and its role."""
        return _stats(self._replicas.values(), self.role)

    def _forget_gone_replicas(self) -> None:
        live = {r.unique_id for r in self._replicas}
        for gone in self._known - live:
            logger.info("replica %s left the fleet; forgetting its prefixes", gone)
            self.policy.forget_replica(gone)
            with contextlib.suppress(KeyError):  # never counted: nothing was routed to it here
                self.metrics.replica_load.remove(self.metrics.model_name, gone)
        self._known = live


def _routing(pending_request: PendingRequest | None) -> dict[str, Any]:
    routing = pending_request.kwargs.get("routing") if pending_request is not None else None
    return routing or {}


def _pin(pending_request: PendingRequest | None) -> str | None:
    pin = _routing(pending_request).get(PIN_REPLICA)
    return str(pin) if pin is not None else None


def _hints(pending_request: PendingRequest | None) -> RoutingHints | None:
    routing = _routing(pending_request)
    if "prefix_keys" not in routing:
        return None
    return RoutingHints(tuple(routing["prefix_keys"]), int(routing["load_tokens"]))


def _pinned_replicas(
    candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
) -> list[list[RunningReplica]] | None:
    """The one replica a pinned request must go to (none while it is not among the candidates: Ray
    then asks again as replicas change); None for a request that is not pinned."""
    pin = _pin(pending_request)
    if pin is None:
        return None
    return [[r for r in candidate_replicas if r.replica_id.unique_id == pin]]


class StatsPowerOfTwoRouter(PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default router, unchanged, plus the replicas' stats for the fleet's /metrics: what
    `--fleet-router ray-default` runs, so that both routers can be measured the same way."""

    def initialize_state(self, model_name: str = "", role: str = "both", **_: Any) -> None:
        self.role = role
        self.stats_metrics = FleetMetrics.for_model(model_name)
        self.stats_metrics.stats_sources.append(self.replica_stats)

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        return _stats(self._replicas.values(), self.role)


def _stats(replicas: Iterable[RunningReplica], role: str) -> dict[str, dict[str, Any]]:
    return {r.replica_id.unique_id: {**r.routing_stats, ROLE: role} for r in replicas}
