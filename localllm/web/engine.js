// Live engine figures in the top bar, as the TUI's engine panel shows them: slots busy, queue, tokens/s and
// prefix-cache hits, from /api/ps and /metrics, refreshed while the page is visible.

import { call, getJson } from "./api.js";

const EVERY_MS = 2000;

let last = null; // {tokens, at}: the generated-token counter at the previous refresh

function generatedTokens(metrics) {
  let total = 0;
  for (const line of metrics.split("\n")) {
    if (line.startsWith("localllm_generated_tokens_total")) total += Number(line.split(" ").at(-1)) || 0;
  }
  return total;
}

async function refresh() {
  const [ps, metrics] = await Promise.all([getJson("/api/ps"), call("/metrics").then((r) => r.text())]);
  const tokens = generatedTokens(metrics);
  const now = performance.now();
  const rate = last && now > last.at ? ((tokens - last.tokens) * 1000) / (now - last.at) : 0;
  last = { tokens, at: now };
  let busy = 0;
  let slots = 0;
  let queued = 0;
  let hits = 0;
  for (const m of ps.models) {
    busy += m.slots_busy;
    slots += m.slots_total;
    queued += m.queue_depth;
    hits += Object.values(m.prefix_cache_hits || {}).reduce((a, b) => a + b, 0);
  }
  const figures = document.getElementById("engine");
  figures.textContent = ps.models.length
    ? `slots ${busy}/${slots} · queue ${queued} · ${rate.toFixed(1)} tokens/s · cache hits ${hits}`
    : "no model loaded";
  figures.dataset.slotsBusy = String(busy);
}

export function startEngineFigures() {
  const tick = () => {
    if (document.visibilityState === "visible") refresh().catch(() => {});
  };
  tick();
  setInterval(tick, EVERY_MS);
}
