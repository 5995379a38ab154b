"""What a gateway process is told at start-up: each field is a flag of ``dsmesh gateway``
(dsmesh/options/fields.py); those marked ``up`` are offered by ``dsmesh up`` too."""

from __future__ import annotations

from dataclasses import dataclass

from dsmesh.gateway.openai_fields import UNKNOWN_FIELD_POLICIES
from dsmesh.gateway.reasoning import check_reasoning_parser
from dsmesh.options import parse as argtypes
from dsmesh.options.fields import REQUIRED, option
from dsmesh.runtime.security import ENV_API_KEYS, api_key
from dsmesh.runtime.server_options import ServerOptions


@dataclass(frozen=True)
class GatewayConfig(ServerOptions):
    broker_address: str = option(REQUIRED, "kv_broker address HOST:PORT", flag="--broker")
    # the CLI resolves --model (absent: the tiny built-in model) to its folder
    model_dir: str = option(
        REQUIRED,
        "checkpoint folder (tokenizer, chat template)",
        flag="--model",
        cli_default=None,
        default_text="the tiny built-in model",
    )
    grpc_port: int = option(50051, "gRPC port (0 = any free port)", parse=argtypes.port)
    http_port: int = option(8000, "HTTP port (0 = any free port)", parse=argtypes.port)
    # model ids of the OpenAI routes, any of which a request may use; empty: the folder's name
    served_model_names: tuple[str, ...] = option(
        (),
        "model id in the OpenAI routes; repeat it or give a comma list for aliases, any of "
        "which a request may use",
        flag="--served-model-name",
        metavar="NAME",
        default_text="the model folder's name",
    )
    request_timeout_s: float = option(600.0, "seconds per request")
    handoff_timeout_s: float = option(
        30.0, "seconds a request may wait for its prompt's KV", up=True
    )
    max_body_bytes: int = option(8 << 20, "largest accepted HTTP body")
    max_inflight: int = option(
        512, "requests dispatched to instances at most; more wait in the queue", up=True
    )
    max_queued: int = option(
        1024,
        "requests waiting in the gateway's queue at most; beyond it clients get 429 / "
        "RESOURCE_EXHAUSTED (0: no queue)",
        up=True,
    )
    migration_limit: int = option(
        3,
        "times a request may move to another (or the restarted) instance when the one "
        "serving it dies, resuming with the tokens already streamed; 0: such a request "
        "fails UNAVAILABLE (docs/RELIABILITY.md)",
        metavar="N",
        up=True,
    )
    kv_routing_weight: float = option(
        1.0,
        "KV-aware routing: what one prompt token cached on an instance weighs against one "
        "token of load (queued prefill tokens, free KV tokens); 0: route by load alone "
        "(docs/GATEWAY.md)",
        metavar="W",
        up=True,
    )
    # "deepseek-r1": chat's <think>...</think> goes to reasoning_content
    # (dsmesh/gateway/reasoning.py)
    reasoning_parser: str = option(
        "",
        "split a reasoning model's output in chat completions: deepseek-r1 puts "
        "<think>...</think> in reasoning_content (docs/GATEWAY.md)",
        metavar="NAME",
        default_text="off",
        up=True,
    )
    # "error": OpenAI's 400 naming the field; "ignore": vLLM's way (openai_fields.py)
    unknown_fields: str = option(
        "error",
        "what an OpenAI request field the gateway does not know gets: error (OpenAI's 400 "
        "naming it) or ignore (vLLM's: logged and not read)",
        choices=UNKNOWN_FIELD_POLICIES,
        up=True,
    )
    # empty: no key needed; ``dsmesh up`` passes them on through the environment
    api_keys: tuple[str, ...] = option(
        (),
        "require 'Authorization: Bearer KEY' on HTTP and gRPC (repeatable; the environment "
        "variable takes a comma list, which keeps keys out of the process list)",
        flag="--api-key",
        metavar="KEY",
        parse=api_key,
        env=ENV_API_KEYS,
        group="security (docs/SECURITY.md)",
        up=True,
        repr=False,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.kv_routing_weight >= 0:
            raise ValueError(f"--kv-routing-weight must be >= 0, got {self.kv_routing_weight}")
        if self.migration_limit < 0:
            raise ValueError(f"--migration-limit must be >= 0, got {self.migration_limit}")
        check_reasoning_parser(self.reasoning_parser)
