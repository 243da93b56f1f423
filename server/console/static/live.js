// The live view: queue sizes, throughput, latency percentiles and KV usage over the last minute, all from
// the `live` figures of GET /v1/engine/state (the engine's per-step stats, as /metrics gets them).

import { drawLineChart } from "./chart.js";
import { numBlocks, percent, tableRow } from "./state.js";

const ms = (seconds) => (seconds < 0.01 ? `${(seconds * 1000).toFixed(2)} ms` : `${Math.round(seconds * 1000)} ms`);
const percentiles = (figures) => (figures ? `${ms(figures.p50)} / ${ms(figures.p90)} / ${ms(figures.p99)}` : "–");

export class LiveView {
  constructor(root) {
    this.root = root;
  }

  $(id) {
    return this.root.querySelector(`#${id}`);
  }

  update(state) {
    const { live, requests, kv_cache: kv } = state;
    const figures = {
      "live-running": requests.running.length,
      "live-waiting": waitingText(requests),
      "live-preempted": requests.num_preempted_waiting,
      "live-rate": live.output_tokens_per_s.toFixed(1),
      "live-ttft": percentiles(live.time_to_first_token_s),
      "live-itl": percentiles(live.inter_token_latency_s),
      "live-kv": `${percent(kv.blocks.used / kv.blocks.total)} (${kv.blocks.used} of ${kv.blocks.total} blocks)`,
      "live-hit-rate": live.prefix_cache_hit_rate === null ? "–" : percent(live.prefix_cache_hit_rate),
      "live-spec": live.spec_acceptance_length === null ? "–" : live.spec_acceptance_length.toFixed(2),
      "live-preemptions": live.num_preemptions.reduce((sum, count) => sum + count, 0),
    };
    for (const [id, text] of Object.entries(figures)) this.$(id).textContent = text;

    drawLineChart(this.$("chart-kv"), [{ values: live.kv_usage, colour: "#2563eb" }], { max: 1, format: percent });
    drawLineChart(this.$("chart-tokens"), [{ values: live.num_output_tokens, colour: "#059669" }], {
      format: (value) => value.toFixed(0),
    });
    drawLineChart(
      this.$("chart-queues"),
      [
        { values: live.num_running, colour: "#2563eb" },
        { values: live.num_waiting, colour: "#d97706" },
        { values: live.num_preempted_waiting, colour: "#dc2626" },
      ],
      { format: (value) => value.toFixed(0) },
    );
    this.$("live-requests").replaceChildren(...requests.running.map(requestRow));
  }
}

// The waiting count, and how many wait at each priority once any priority is not the default.
function waitingText(requests) {
  const byPriority = requests.waiting_by_priority;
  if (byPriority.every(([priority]) => priority === 0)) return requests.num_waiting;
  return `${requests.num_waiting} (${byPriority.map(([priority, count]) => `${count} at ${priority}`).join(", ")})`;
}

function requestRow(request) {
  return tableRow([
    request.request_id,
    request.priority,
    request.num_prompt_tokens,
    request.num_output_tokens,
    numBlocks(request),
    request.num_preemptions,
  ]);
}
