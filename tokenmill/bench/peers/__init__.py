"""Peer engines for `tokenmill bench compare`: each runs in a subprocess from its own virtualenv, built by
`tokenmill bench setup-peer NAME`, through a driver script that speaks drivers/peer_protocol.py.

    from tokenmill.bench.peers import PEERS, is_set_up, setup_peer
    setup_peer(PEERS["ct2"])
"""

from tokenmill.bench.peers import ct2, hf, llamacpp, vllm
from tokenmill.bench.peers.base import PeerSpec, is_set_up, not_set_up_note, peer_root, run_driver, setup_peer

PEERS: dict[str, PeerSpec] = {spec.name: spec for spec in (vllm.SPEC, llamacpp.SPEC, ct2.SPEC, hf.SPEC)}

__all__ = ["PEERS", "PeerSpec", "is_set_up", "not_set_up_note", "peer_root", "run_driver", "setup_peer"]
