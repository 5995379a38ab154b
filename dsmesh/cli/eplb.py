"""``dsmesh eplb serve|dump|simulate``: the expert-parallel load balancer and its toolkit."""

from __future__ import annotations

import argparse

from dsmesh.cli.server_flags import run_server, server_config_from, tls_config_from
from dsmesh.eplb_svc.config import EPLBConfig
from dsmesh.options import parse as argtypes
from dsmesh.options.fields import add_options
from dsmesh.runtime.security import SecurityOptions


def configure(p: argparse.ArgumentParser) -> None:
    p.description = (
        "EPLB (docs/EPLB.md): 'serve' runs dsmesh.v1.EPLB, 'dump' writes an "
        "instance's recorded expert load, 'simulate' predicts the balancedness of placements."
    )
    tools = p.add_subparsers(dest="eplb_command", metavar="TOOL", required=True)

    s = tools.add_parser(
        "serve",
        help="run the EPLB controller",
        description="Serve dsmesh.v1.EPLB: EP instances stream their expert load; every "
        "--interval (and on the Rebalance RPC) each instance gets a new placement when its "
        "predicted balancedness gain exceeds --threshold. Prints 'eplb listening on "
        "HOST:PORT' once ready; SIGTERM/SIGINT stop it gracefully.",
    )
    add_options(s, EPLBConfig)
    s.set_defaults(func=run_serve)

    dump = tools.add_parser(
        "dump",
        help="write an instance's recorded expert load (JSON)",
        description="Fetch an instance's load window from eplb (GetLoad) and write it in the "
        "load file format of docs/EPLB.md.",
    )
    dump.add_argument("--eplb", required=True, metavar="HOST:PORT", help="eplb address")
    dump.add_argument(
        "--instance", default="", metavar="ID", help="instance id (needed when several report)"
    )
    dump.add_argument("--out", required=True, metavar="FILE.json", help="where to write")
    add_options(dump, SecurityOptions)
    dump.set_defaults(func=run_dump)

    sim = tools.add_parser(
        "simulate",
        help="balancedness of the trivial and EPLB placements for a load file",
        description="Predict per-rank MoE load (tokens split evenly over replicas) of the "
        "trivial placement, EPLB's and, when the file records one of the same size, the "
        "placement the load was recorded under; print balancedness per layer and overall.",
    )
    sim.add_argument("--load", required=True, metavar="FILE", help="load file (JSON)")
    sim.add_argument(
        "--ep-size", type=argtypes.positive, required=True, metavar="N", help="EP ranks"
    )
    sim.add_argument(
        "--num-redundant-experts",
        type=argtypes.count,
        default=0,
        metavar="R",
        help="physical experts beyond the logical ones (default 0)",
    )
    sim.add_argument(
        "--nodes", type=argtypes.positive, default=1, metavar="K", help="nodes (default 1)"
    )
    sim.add_argument(
        "--groups",
        type=argtypes.positive,
        default=None,
        metavar="G",
        help="expert groups (default: the file's num_groups, else 1)",
    )
    sim.add_argument("--plot", default=None, metavar="FILE.png", help="write a heatmap")
    sim.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sim.set_defaults(func=run_simulate)


def run_serve(args: argparse.Namespace) -> int:
    from dsmesh.eplb_svc.service import serve

    return run_server("eplb", serve, server_config_from(EPLBConfig, args))


def run_dump(args: argparse.Namespace) -> int:
    import grpc

    from dsmesh.eplb_svc.loadfile import write_load
    from dsmesh.runtime.grpc_server import set_channel_defaults, sync_channel
    from dsmesh.v1 import eplb_pb2 as pb
    from dsmesh.v1 import eplb_pb2_grpc

    set_channel_defaults(tls_config_from(args), args.max_message_bytes)
    with sync_channel(args.eplb) as chan:
        stub = eplb_pb2_grpc.EPLBStub(chan)
        try:
            reply = stub.GetLoad(pb.GetLoadRequest(instance_id=args.instance), timeout=30)
        except grpc.RpcError as exc:
            message = f"GetLoad from {args.eplb}: {exc.code().name}: {exc.details()}"
            raise ValueError(message) from None
    if not reply.instances:
        raise ValueError(f"no instance has reported load to {args.eplb}")
    if len(reply.instances) > 1:
        ids = ", ".join(i.instance_id for i in reply.instances)
        raise ValueError(f"several instances report load ({ids}): pick one with --instance")
    write_load(args.out, load_record(reply.instances[0]))
    print(f"wrote {args.out}")
    return 0


def load_record(inst) -> dict[str, object]:
    """An ``InstanceLoad`` proto as a load file record (docs/EPLB.md)."""
    layers, physical, logical = (
        inst.num_moe_layers,
        inst.num_physical_experts,
        inst.num_logical_experts,
    )

    def rows(values, cols: int) -> list[list[int]]:
        flat = list(values)
        return [flat[i * cols : (i + 1) * cols] for i in range(layers)]

    return {
        "num_moe_layers": layers,
        "num_physical_experts": physical,
        "window_steps": inst.window_steps,
        "tokens_per_expert": rows(inst.tokens_per_expert, physical),
        "num_logical_experts": logical,
        "tokens_per_logical_expert": rows(inst.tokens_per_logical_expert, logical),
        "physical_to_logical": rows(inst.physical_to_logical, physical),
        "ep_size": inst.ep_size,
        "num_nodes": inst.num_nodes,
        "num_groups": inst.num_groups,
        "instance_id": inst.instance_id,
        "version": inst.version,
    }


def run_simulate(args: argparse.Namespace) -> int:
    import json

    from dsmesh.eplb_svc.loadfile import read_load
    from dsmesh.eplb_svc.simulate import format_table, plot_heatmap, simulate

    load = read_load(args.load)
    groups = args.groups if args.groups is not None else (load.num_groups or 1)
    sim = simulate(load, args.ep_size, args.num_redundant_experts, args.nodes, groups)
    if args.json:
        out = {
            "overall": sim.overall(),
            "per_layer": {k: v.tolist() for k, v in sim.per_layer().items()},
        }
        print(json.dumps(out))
    else:
        print(format_table(sim))
    if args.plot:
        plot_heatmap(sim, args.plot)
        print(f"wrote {args.plot}")
    return 0
