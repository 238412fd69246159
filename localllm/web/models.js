// The models page: what is loaded (ps, with unload), the store (delete), the catalog, and pull with progress.

import { call, getJson, ndjson } from "./api.js";
import { el, formatBytes } from "./render.js";

const $ = (id) => document.getElementById(id);

let pulling = null; // the AbortController of the pull in progress
let changed = () => {};

export function initModels({ onChange }) {
  changed = onChange;
  $("pull-form").addEventListener("submit", (event) => {
    event.preventDefault();
    pull($("pull-name").value.trim());
  });
  $("pull-cancel").addEventListener("click", () => pulling?.abort());
}

export async function refreshModels() {
  const [tags, ps, catalog] = await Promise.all([getJson("/api/tags"), getJson("/api/ps"), getJson("/api/catalog")]);
  const stored = new Set(tags.models.map((m) => m.name));
  $("loaded").replaceChildren(...(ps.models.length ? ps.models.map(loadedRow) : [emptyRow(6, "nothing loaded")]));
  $("stored").replaceChildren(...(tags.models.length ? tags.models.map(storedRow) : [emptyRow(4, "no models yet")]));
  $("catalog").replaceChildren(...catalog.models.map((entry) => catalogRow(entry, stored.has(entry.name))));
}

function cells(row, values) {
  for (const value of values) row.append(value instanceof Node ? cellOf(value) : el("td", "", String(value)));
  return row;
}

function cellOf(node) {
  const cell = el("td");
  cell.append(node);
  return cell;
}

function emptyRow(span, text) {
  const row = el("tr");
  const cell = el("td", "empty", text);
  cell.colSpan = span;
  row.append(cell);
  return row;
}

function button(label, action, className = "") {
  const node = el("button", className, label);
  node.type = "button";
  node.addEventListener("click", () => action(node));
  return node;
}

function loadedRow(m) {
  const row = el("tr");
  row.dataset.model = m.name;
  const kv = m.kv_cells ? `${m.kv_used}/${m.kv_cells} tokens ${m.kv_type}` : m.kv_type;
  const where = m.placement?.length
    ? m.placement.map((p) => `${p.device}: ${p.layers} layers`).join(", ")
    : `${m.gpu_layers} GPU layers`;
  const draft = m.draft ? ` · draft ${m.draft.name}` : m.speculation !== "none" ? ` · ${m.speculation}` : "";
  return cells(row, [
    m.name,
    `${m.slots_busy}/${m.slots_total} busy, ${m.queue_depth} queued`,
    `${m.context_length} per slot`,
    kv,
    `${formatBytes(m.size)} (${formatBytes(m.size_vram)} on GPU) · ${where}${draft}`,
    button("Unload", unload.bind(null, m.name)),
  ]);
}

function storedRow(m) {
  const row = el("tr");
  row.dataset.model = m.name;
  const details = [m.details.family, m.details.parameter_size, m.details.quantization_level].filter(Boolean);
  const actions = el("span", "actions");
  actions.append(button("Plan", plan.bind(null, m.name)), button("Delete", remove.bind(null, m.name)));
  return cells(row, [m.name, details.join(" · "), formatBytes(m.size), actions]);
}

// The memory plan (POST /api/plan, what `localllm plan` prints): will it fit, and where, before a load.
async function plan(name) {
  const options = {};
  const ctx = Number.parseInt($("plan-ctx").value, 10);
  const slots = Number.parseInt($("plan-slots").value, 10);
  if (ctx > 0) options.num_ctx = ctx;
  if (slots > 0) options.num_parallel = slots;
  const result = $("plan-result");
  result.textContent = `planning ${name}…`;
  try {
    const answer = await (await call("/api/plan", { method: "POST", body: { model: name, options } })).json();
    result.replaceChildren(...answer.models.map(planLine), planVerdict(answer));
  } catch (error) {
    result.textContent = `plan failed: ${error.message}`;
  }
}

function planLine(m) {
  const parts = [`weights ${formatBytes(m.weights)}`, `KV ${formatBytes(m.kv_total)} (${m.kv_type})`];
  if (m.adapters) parts.push(`adapters ${formatBytes(m.adapters)}`);
  if (m.projector) parts.push(`vision ${formatBytes(m.projector)}`);
  parts.push(`compute ${formatBytes(m.compute)}`);
  const where = m.placement?.devices.filter((d) => d.layers).map((d) => `${d.device} ${d.layers} layers`) ?? [];
  const line = el("div", "plan-row");
  line.dataset.model = m.model;
  line.textContent =
    `${m.model}: ${m.num_parallel} slots × ${m.num_ctx} tokens → ${formatBytes(m.total)} ` +
    `(${parts.join(", ")})${where.length ? ` · ${where.join(", ")}` : ""}`;
  return line;
}

function planVerdict(answer) {
  const verdict = el("div", answer.fits === false ? "plan-verdict error" : "plan-verdict");
  verdict.textContent =
    answer.available === null
      ? `needs ${formatBytes(answer.total)} (the memory available is unknown here)`
      : `needs ${formatBytes(answer.total)} of ${formatBytes(answer.available)} available: ` +
        (answer.fits ? "fits" : "does not fit — lower the context or the slots");
  return verdict;
}

function catalogRow(entry, stored) {
  const row = el("tr");
  row.dataset.model = entry.name;
  const action = stored ? el("span", "muted", "in the store") : button("Pull", () => pull(entry.name));
  return cells(row, [entry.name, entry.description, entry.capabilities, formatBytes(entry.size), action]);
}

async function unload(name) {
  await call("/api/generate", { method: "POST", body: { model: name, keep_alive: 0 } });
  await refreshAll();
}

// Deleting asks twice: the first click turns the button into its confirmation.
async function remove(name, node) {
  if (!node.classList.contains("confirm")) {
    node.classList.add("confirm");
    node.textContent = "Delete for good?";
    return;
  }
  try {
    await call("/api/delete", { method: "DELETE", body: { model: name } });
    say(`deleted ${name}`);
  } catch (error) {
    say(`delete failed: ${error.message}`);
  }
  await refreshAll();
}

function say(text) {
  $("pull-status").textContent = text;
}

async function pull(name) {
  if (!name || pulling) return;
  const bar = $("pull-progress");
  pulling = new AbortController();
  $("pull-cancel").hidden = false;
  $("pull-button").disabled = true;
  bar.hidden = false;
  bar.removeAttribute("value");
  say(`pulling ${name}`);
  try {
    const response = await call("/api/pull", { method: "POST", body: { model: name }, signal: pulling.signal });
    for await (const step of ndjson(response)) showProgress(name, step);
  } catch (error) {
    say(error.name === "AbortError" ? `cancelled: ${name} (a later pull resumes it)` : `pull failed: ${error.message}`);
  } finally {
    pulling = null;
    $("pull-cancel").hidden = true;
    $("pull-button").disabled = false;
    await refreshAll();
  }
}

function showProgress(name, step) {
  const bar = $("pull-progress");
  if (step.total) {
    bar.max = step.total;
    bar.value = step.completed || 0;
  }
  if (step.status === "success") {
    bar.max = 1;
    bar.value = 1;
    say(`done: ${name} is in the store`);
    return;
  }
  const share = step.total ? ` ${formatBytes(step.completed || 0)} of ${formatBytes(step.total)}` : "";
  say(`${step.status}${share}`);
}

async function refreshAll() {
  await Promise.all([refreshModels(), changed()]);
}
