"""GET /metrics: the engines' state in Prometheus' text format, for dashboards and alerts.

Each scrape asks every engine replica for fresh stats; each sample carries its replica's index
(``replica="0"``, …). Counters count since that engine started, so a restarted engine shows as
a counter reset, which Prometheus handles.
"""

from __future__ import annotations

from protocol import EngineStats

# (name, type, help, value of the stats)
_METRICS = [
    ("tandem_requests_running", "gauge", "Requests decoding or prefilling.", "num_running"),
    ("tandem_requests_waiting", "gauge", "Requests queued for cache blocks.", "num_waiting"),
    ("tandem_requests_finished_total", "counter", "Requests finished or aborted.", "num_finished"),
    (
        "tandem_prompt_tokens_total",
        "counter",
        "Prompt tokens computed (prefix-cache hits excluded).",
        "num_prompt_tokens",
    ),
    (
        "tandem_prefix_cache_hit_tokens_total",
        "counter",
        "Prompt tokens found in the prefix cache.",
        "num_cached_prompt_tokens",
    ),
    ("tandem_generation_tokens_total", "counter", "Tokens generated.", "num_generated_tokens"),
    ("tandem_preemptions_total", "counter", "Requests preempted for cache.", "num_preemptions"),
    ("tandem_kv_cache_blocks", "gauge", "KV cache blocks in all.", "num_total_blocks"),
    (
        "tandem_kv_cache_free_blocks",
        "gauge",
        "KV cache blocks no request holds.",
        "num_free_blocks",
    ),
]


def render_metrics(replicas: list[EngineStats | None]) -> str:
    """The exposition text of each replica's stats, by index; a replica with no stats (not
    answering) has only its ``tandem_engine_up{replica="i"} 0``."""
    lines = [
        "# HELP tandem_engine_up Whether the engine replica answered this scrape.",
        "# TYPE tandem_engine_up gauge",
    ]
    lines += [
        f'tandem_engine_up{{replica="{index}"}} {0 if stats is None else 1}'
        for index, stats in enumerate(replicas)
    ]
    # A family with no replica answering keeps its HELP and TYPE lines, as prometheus-client's.
    answering = [(index, stats) for index, stats in enumerate(replicas) if stats is not None]
    for name, kind, help_text, field in _METRICS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        lines += [
            f'{name}{{model="{_escape(stats.model_name)}",replica="{index}"}} '
            f"{getattr(stats, field)}"
            for index, stats in answering
        ]
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
