// The live engine panel: GET /stats once a second (server/routes/stats.py, the engine's
// EngineStats), throughputs from the differences between consecutive readings, and a
// sparkline of the last minute. The same poll drives the top bar's online/offline dot, and
// tells an engine that is down (the server answers 503) from a server that does not answer.
// Opening and closing it is panels.js's.

import { ServerUnreachable, fetchStats } from "./api.js";

const POLL_MS = 1000;
const HIDDEN_POLL_MS = 5000; // panel closed: only the top bar's dot needs the engine's state
const HISTORY = 60; // sparkline points: a minute

const $ = (id) => document.getElementById(id);

function rate(value) {
  return value >= 100 ? `${value.toFixed(0)} tok/s` : `${value.toFixed(1)} tok/s`;
}

function percent(value) {
  return `${(100 * value).toFixed(1)}%`;
}

export class EnginePanel {
  constructor(onOnline) {
    this.onOnline = onOnline; // (online: boolean, serverUp: boolean) => void, on every change
    this.panel = $("engine-panel");
    this.state = $("engine-state");
    this.dot = $("status-dot");
    this.last = null;
    this.online = null;
    this.serverUp = null;
    this.generation = [];
    this.prompt = [];
    this.started = false;
    this.polling = false;
    this.timer = 0;
  }

  /** Reads the engine now (the panel was just opened). */
  refresh() {
    if (this.started) this.schedule(0);
  }

  start() {
    this.started = true;
    this.schedule(0);
  }

  schedule(delay) {
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.tick(), delay);
  }

  async tick() {
    if (this.polling) return; // the poll in flight schedules the next
    this.polling = true;
    await this.poll();
    this.polling = false;
    this.schedule(this.panel.hidden ? HIDDEN_POLL_MS : POLL_MS);
  }

  async poll() {
    let stats;
    try {
      stats = await fetchStats(AbortSignal.timeout(3 * POLL_MS));
    } catch (error) {
      this.setOnline(false, !(error instanceof ServerUnreachable));
      this.last = null;
      return;
    }
    this.setOnline(true, true);
    const last = this.last;
    this.last = stats;
    $("stat-running").textContent = stats.num_running;
    $("stat-waiting").textContent = stats.num_waiting;
    $("stat-kv").textContent = percent(stats.kv_cache_usage);
    $("stat-kv-meter").value = stats.kv_cache_usage;
    $("stat-servers").textContent = stats.num_connected_servers;
    $("stat-finished").textContent = stats.num_finished;
    if (!last || last.engine_pid !== stats.engine_pid) return; // rates need two readings
    const seconds = Math.max(stats.time - last.time, 1e-3);
    const prompt = (stats.num_prompt_tokens - last.num_prompt_tokens) / seconds;
    const generation = (stats.num_generated_tokens - last.num_generated_tokens) / seconds;
    const hits = stats.num_cached_prompt_tokens - last.num_cached_prompt_tokens;
    const looked = hits + stats.num_prompt_tokens - last.num_prompt_tokens;
    $("stat-prompt").textContent = rate(prompt);
    $("stat-generation").textContent = rate(generation);
    // The last second's share when prompts came in, else the share since the engine started.
    $("stat-prefix").textContent = looked
      ? `${percent(hits / looked)} (now)`
      : `${percent(stats.prefix_cache_hit_rate)} (overall)`;
    this.plot(prompt, generation);
  }

  setOnline(online, serverUp) {
    if (online === this.online && serverUp === this.serverUp) return;
    this.online = online;
    this.serverUp = serverUp;
    const state = online ? "online" : serverUp ? "offline" : "server not answering";
    this.state.textContent = state;
    this.state.classList.toggle("offline", !online);
    this.dot.classList.toggle("offline", !online);
    this.dot.classList.toggle("online", online);
    this.dot.setAttribute("aria-label", online ? "engine online" : serverUp ? "engine offline" : "server not answering");
    this.onOnline(online, serverUp);
  }

  plot(prompt, generation) {
    for (const [series, value] of [
      [this.generation, generation],
      [this.prompt, prompt],
    ]) {
      series.push(value);
      if (series.length > HISTORY) series.shift();
    }
    const peak = Math.max(1, ...this.generation, ...this.prompt);
    $("sparkline-peak").textContent = rate(peak);
    // The newest reading at the right edge; a series shorter than a minute starts further in.
    const points = (series) =>
      series
        .map((value, i) => {
          const x = ((HISTORY - series.length + i) * 240) / (HISTORY - 1);
          return `${x.toFixed(1)},${(58 - (value / peak) * 56).toFixed(1)}`;
        })
        .join(" ");
    $("sparkline-generation").setAttribute("points", points(this.generation));
    $("sparkline-prompt").setAttribute("points", points(this.prompt));
  }
}
