"""GET /metrics: the engine's state in Prometheus' text format, for dashboards and alerts.

Each scrape asks the engine for fresh stats; counters count since the engine started,
so a restarted engine shows as a counter reset, which Prometheus handles.
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


def render_metrics(stats: EngineStats | None) -> str:
    """The exposition text; with no stats (engine not answering) only ``tandem_engine_up 0``."""
    lines = [
        "# HELP tandem_engine_up Whether the engine answered this scrape.",
        "# TYPE tandem_engine_up gauge",
        f"tandem_engine_up {0 if stats is None else 1}",
    ]
    if stats is not None:
        labels = f'{{model="{_escape(stats.model_name)}"}}'
        for name, kind, help_text, field in _METRICS:
            lines += [
                f"# HELP {name} {help_text}",
                f"# TYPE {name} {kind}",
                f"{name}{labels} {getattr(stats, field)}",
            ]
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
