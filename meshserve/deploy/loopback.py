"""Keep Ray Serve's inter-deployment gRPC server on the node's own address.

Ray Serve 2.60 starts, in every replica, a gRPC server for deployment-to-deployment calls bound to
``[::]:0`` (all interfaces; ray-project/ray#64544), even when the whole Ray cluster runs on
127.0.0.1. Callers reach a replica at its node's IP, so binding there instead loses nothing and
keeps a loopback cluster on loopback. This is the one place meshserve patches Ray's internals;
it is applied when the deployment modules are imported, which a replica does before it starts
that server. Remove it once Ray offers a setting.
"""

from __future__ import annotations

import functools


def bind_serve_grpc_to_node_ip() -> None:
    from ray.serve._private import replica

    original = replica.add_port_to_grpc_server
    if getattr(original, "_meshserve_node_ip", False):
        return

    @functools.wraps(original)
    def add_port(server, address: str) -> int:
        if address.startswith("[::]:"):
            import ray

            address = f"{ray.util.get_node_ip_address()}:{address.rsplit(':', 1)[1]}"
        return original(server, address)

    add_port._meshserve_node_ip = True
    replica.add_port_to_grpc_server = add_port
