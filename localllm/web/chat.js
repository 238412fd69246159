// The chat view: the open conversation, its settings, the composer with attachments, and the streamed answer.

import { ApiError, call, getJson, ndjson } from "./api.js";
import { renderMessage } from "./messages.js";
import { el, formatBytes } from "./render.js";
import { newConversation, saveConversation } from "./store.js";
import { loadContext, mcpCommand, promptMessages, resourceAttachment } from "./mcp_context.js";
import { MAX_STEPS, callKey, loadTools, offeredTools, renderToolCard, runToolMessage, toolMessage } from "./tools.js";

const $ = (id) => document.getElementById(id);
const TEXT_FILE_LIMIT = 512 * 1024; // a text file goes into the prompt whole: more would not fit a small context
const SAVE_EVERY_MS = 1000; // a streaming answer is written this often, so a reload mid-answer keeps most of it
// Sampling and context options a conversation may set; an empty field leaves the model's own default.
const OPTIONS = {
  temperature: Number,
  top_p: Number,
  top_k: parseInt,
  min_p: Number,
  repeat_penalty: Number,
  num_ctx: parseInt,
  num_predict: parseInt,
  seed: parseInt,
};

let conversation = null;
let streaming = null; // {controller, conversation} while an answer streams
let pending = []; // attachments for the next message
let editing = null; // index of the user message being edited, or null
let listChanged = () => {};

export function initChat({ onListChange }) {
  listChanged = onListChange;
  loadTools(); // the server's MCP tools, when it runs with --mcp (tools.js)
  loadContext($("mcp-pick")); // and its prompts and resources (mcp_context.js)
  $("mcp-pick").addEventListener("change", pickContext);
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send(performance.now());
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send(performance.now());
    }
  });
  $("stop").addEventListener("click", stop);
  $("attach").addEventListener("change", (event) => addFiles(event.target.files).then(() => (event.target.value = "")));
  $("prompt").addEventListener("paste", (event) => {
    if (event.clipboardData.files.length) {
      event.preventDefault();
      addFiles(event.clipboardData.files);
    }
  });
  const chat = $("chat-view");
  chat.addEventListener("dragover", (event) => {
    event.preventDefault();
    chat.classList.add("dropping");
  });
  chat.addEventListener("dragleave", () => chat.classList.remove("dropping"));
  chat.addEventListener("drop", (event) => {
    event.preventDefault();
    chat.classList.remove("dropping");
    addFiles(event.dataTransfer.files);
  });
  $("model").addEventListener("change", () => {
    localStorage.setItem("localllm.model", $("model").value);
    if (conversation) conversation.model = $("model").value;
  });
  $("settings-toggle").addEventListener("click", () => ($("settings").hidden = !$("settings").hidden));
  $("settings").addEventListener("change", readSettings);
  $("cancel-edit").addEventListener("click", cancelEdit);
}

export function isStreaming() {
  return streaming !== null;
}

export function stop() {
  streaming?.controller.abort();
}

export function current() {
  return conversation;
}

export function openConversation(next) {
  if (streaming) stop();
  conversation = next;
  cancelEdit();
  if (conversation.model && [...$("model").options].some((o) => o.value === conversation.model)) {
    $("model").value = conversation.model;
  }
  fillSettings();
  renderAll();
}

export function startConversation() {
  openConversation(newConversation($("model").value));
  $("prompt").focus();
}

// The store's models in the picker, the loaded ones marked.
export async function loadModels() {
  const [tags, ps] = await Promise.all([getJson("/api/tags"), getJson("/api/ps")]);
  const loaded = new Set(ps.models.map((m) => m.name));
  const select = $("model");
  const chosen = conversation?.model || select.value || localStorage.getItem("localllm.model");
  select.replaceChildren(
    ...tags.models.map((m) => {
      const option = el("option", "", loaded.has(m.name) ? `${m.name}  ● loaded` : m.name);
      option.value = m.name;
      return option;
    }),
  );
  if (chosen && tags.models.some((m) => m.name === chosen)) select.value = chosen;
  if (conversation && !conversation.model) conversation.model = select.value;
  $("no-models").hidden = tags.models.length > 0;
}

// ---------------------------------------------------------------------------------------------------- rendering

function renderAll() {
  const list = $("messages");
  const last = conversation.messages.length - 1;
  list.replaceChildren(
    ...conversation.messages.map((message, index) =>
      message.role === "tool"
        ? renderToolCard(message)
        : renderMessage(message, {
            onEdit: message.role === "user" ? () => startEdit(index) : null,
            onRegenerate: message.role === "assistant" && index === last ? regenerate : null,
          }).node,
    ),
  );
  list.scrollTop = list.scrollHeight;
}

export function showError(text) {
  const box = $("error");
  box.textContent = text;
  box.hidden = !text;
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

// ---------------------------------------------------------------------------------------------------- settings

function fillSettings() {
  const settings = conversation.settings || {};
  for (const input of $("settings").querySelectorAll("[data-setting]")) {
    input.value = settings[input.dataset.setting] ?? "";
  }
}

function readSettings() {
  const settings = {};
  const problems = [];
  for (const input of $("settings").querySelectorAll("[data-setting]")) {
    const name = input.dataset.setting;
    const text = input.value.trim();
    if (!text) continue;
    if (name in OPTIONS && !Number.isFinite(OPTIONS[name](text))) problems.push(`${name} must be a number`);
    else if (name === "format" && !isJson(text)) problems.push("the response format must be JSON (a JSON schema)");
    else settings[name] = input.value;
  }
  conversation.settings = settings;
  showError(problems.join("; "));
  if (conversation.messages.length) saveConversation(conversation);
}

function isJson(text) {
  try {
    JSON.parse(text);
    return true;
  } catch {
    return false;
  }
}

// ---------------------------------------------------------------------------------------------------- attachments

async function addFiles(files) {
  for (const file of files) {
    if (file.type.startsWith("image/")) {
      const url = await readAsDataUrl(file);
      pending.push({ kind: "image", name: file.name, type: file.type, data: url.split(",", 2)[1] });
    } else if (file.size > TEXT_FILE_LIMIT) {
      showError(`${file.name} is ${formatBytes(file.size)}: text files up to ${formatBytes(TEXT_FILE_LIMIT)} go in`);
    } else {
      const text = await file.text();
      if (text.includes("\u0000")) showError(`${file.name} is not a text file (images and text files go in)`);
      else pending.push({ kind: "text", name: file.name, text });
    }
  }
  renderPending();
}

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function renderPending() {
  $("attachments").replaceChildren(
    ...pending.map((item, index) => {
      const chip = el("span", "chip", item.name);
      const remove = el("button", "icon", "×");
      remove.type = "button";
      remove.title = `remove ${item.name}`;
      remove.addEventListener("click", () => {
        pending.splice(index, 1);
        renderPending();
      });
      chip.append(remove);
      return chip;
    }),
  );
}

// ---------------------------------------------------------------------------------------------------- sending

function startEdit(index) {
  const message = conversation.messages[index];
  editing = index;
  $("prompt").value = message.content;
  pending = [...(message.attachments || [])];
  renderPending();
  $("editing").hidden = false;
  $("prompt").focus();
}

function cancelEdit() {
  editing = null;
  $("editing").hidden = true;
}

async function send(started) {
  const text = $("prompt").value;
  if (streaming || (!text.trim() && !pending.length)) return;
  if (!$("model").value) {
    showError("no model to chat with: pull one on the Models page");
    return;
  }
  const command = mcpCommand(text);
  if (command) {
    await runCommand(command, started).catch((error) => showError(error.message));
    return;
  }
  if (editing !== null) conversation.messages.splice(editing);
  cancelEdit();
  conversation.model = $("model").value;
  conversation.messages.push({ role: "user", content: text, attachments: pending });
  if (!conversation.title) conversation.title = (text.trim() || pending[0].name).slice(0, 60);
  pending = [];
  renderPending();
  $("prompt").value = "";
  showError("");
  await saveConversation(conversation);
  listChanged();
  await answer(started);
}

// ---------------------------------------------------------------------------------------------------- MCP context

// The MCP picker: a resource is attached at once; a prompt is written into the composer for its arguments.
async function pickContext(event) {
  const [kind, ...rest] = event.target.value.split(":");
  event.target.value = "";
  if (kind === "prompt") {
    $("prompt").value = `/prompt ${rest.join(":")} `;
    $("prompt").focus();
  } else if (kind === "resource") {
    await runCommand({ kind, rest: rest.join(":") }).catch((error) => showError(error.message));
  }
}

// `/resource URI` attaches the resource to the next message; `/prompt NAME ARGS` sends the prompt's messages.
async function runCommand(command, started) {
  if (command.kind === "resource") {
    pending.push(await resourceAttachment(command.rest));
    renderPending();
    $("prompt").value = "";
    showError("");
    return;
  }
  const messages = await promptMessages(command.rest);
  if (editing !== null) conversation.messages.splice(editing);
  cancelEdit();
  conversation.model = $("model").value;
  messages.forEach((m, index) => {
    const attachments = index === 0 ? pending : [];
    conversation.messages.push({ role: m.role, content: m.content, attachments });
  });
  if (!conversation.title) conversation.title = (messages[0]?.content || command.rest).slice(0, 60);
  pending = [];
  renderPending();
  $("prompt").value = "";
  showError("");
  await saveConversation(conversation);
  listChanged();
  if (conversation.messages.at(-1)?.role === "user") await answer(started ?? performance.now());
  else renderAll();
}

function regenerate() {
  if (streaming) return;
  if (conversation.messages.at(-1)?.role === "assistant") conversation.messages.pop();
  answer(performance.now());
}

function wireMessage(message) {
  const files = (message.attachments || []).filter((a) => a.kind === "text" || a.kind === "resource");
  const label = (f) => (f.kind === "resource" ? "Resource" : "File"); // resources as mcp/prompts.py writes them
  const context = files.map((f) => `${label(f)} ${f.name}:\n\`\`\`\n${f.text}\n\`\`\`\n\n`).join("");
  const images = (message.attachments || []).filter((a) => a.kind === "image").map((a) => a.data);
  const wire = { role: message.role, content: context + message.content };
  if (images.length) wire.images = images;
  if (message.tool_calls) wire.tool_calls = message.tool_calls;
  if (message.role === "tool") wire.tool_name = message.tool_name;
  return wire;
}

function chatRequest(conv, tools) {
  const settings = conv.settings || {};
  const messages = settings.system ? [{ role: "system", content: settings.system }] : [];
  messages.push(...conv.messages.map(wireMessage));
  const body = { model: conv.model, messages, stream: true };
  const options = {};
  for (const [name, parse] of Object.entries(OPTIONS)) {
    if (settings[name] !== undefined) options[name] = parse(settings[name]);
  }
  if (Object.keys(options).length) body.options = options;
  if (settings.format) body.format = JSON.parse(settings.format);
  if (tools) body.tools = tools;
  return body;
}

// The answer to the last message. With MCP tools (tools.js), the model may call them: each call becomes a tool card
// that asks before it runs, its result goes back, and the model is asked again, until it answers without a call or
// MAX_STEPS turns; a turn that only repeats calls already answered is dropped and asked again with no tools.
async function answer(started) {
  const conv = conversation;
  const controller = new AbortController();
  streaming = { controller, conversation: conv };
  setBusy(true);
  const offered = await offeredTools();
  const made = new Set();
  let mustAnswer = !offered.length;
  try {
    for (let step = 0; step < MAX_STEPS && !controller.signal.aborted; step++) {
      mustAnswer = mustAnswer || step === MAX_STEPS - 1;
      const calls = await streamTurn(conv, started, controller, mustAnswer ? null : offered);
      if (!calls.length) break;
      if (calls.every((c) => made.has(callKey(c)))) {
        conv.messages.pop();
        mustAnswer = true;
        continue;
      }
      for (const toolCall of calls) {
        made.add(callKey(toolCall));
        const message = toolMessage(toolCall);
        conv.messages.push(message);
        await runToolMessage(message, () => conversation === conv && renderAll(), controller.signal).catch((error) =>
          Object.assign(message, { status: "error", content: `Error: ${error.message}` }),
        );
        if (conversation === conv) renderAll();
        await saveConversation(conv);
      }
    }
  } finally {
    streaming = null;
    setBusy(false);
    await saveConversation(conv);
    if (conversation === conv) renderAll();
    listChanged();
    loadModels().catch(() => {});
  }
}

// One model turn, streamed into a new assistant message; the tool calls it made (none when it answered).
async function streamTurn(conv, started, controller, tools) {
  const body = chatRequest(conv, tools);
  const message = { role: "assistant", content: "", thinking: "", model: conv.model, streaming: true };
  conv.messages.push(message);
  renderAll();
  const view = renderMessage(message, {});
  $("messages").lastElementChild.replaceWith(view.node);
  let saved = performance.now();
  const calls = [];
  try {
    const response = await call("/api/chat", { method: "POST", body, signal: controller.signal });
    for await (const chunk of ndjson(response)) {
      message.content += chunk.message?.content || "";
      message.thinking += chunk.message?.thinking || "";
      calls.push(...(chunk.message?.tool_calls || []));
      if (chunk.done) message.stats = statsOf(chunk);
      view.update(started);
      if (performance.now() - saved > SAVE_EVERY_MS) {
        saved = performance.now();
        saveConversation(conv);
      }
    }
    if (calls.length) message.tool_calls = calls;
  } catch (error) {
    if (!keepFailed(conv, message, error)) conv.messages.pop();
    return [];
  } finally {
    delete message.streaming;
  }
  return calls;
}

// What a failed answer leaves: a refusal before any text (a 400 for an image a model cannot see) is said and the
// empty answer dropped; text already streamed is kept and marked as stopped or cut off.
function keepFailed(conv, message, error) {
  const empty = !message.content && !message.thinking;
  if (error.name === "AbortError") {
    message.partial = "stopped";
    return !empty;
  }
  const reason = error instanceof ApiError ? error.message : `the connection to the server was lost (${error.message})`;
  showError(reason);
  if (empty) return false;
  message.partial = `cut off: ${reason}`;
  return true;
}

function statsOf(chunk) {
  const seconds = (ns) => ns / 1e9;
  return {
    tokens: chunk.eval_count,
    tokensPerSecond: chunk.eval_duration ? chunk.eval_count / seconds(chunk.eval_duration) : null,
    promptTokens: chunk.prompt_eval_count,
    cachedTokens: chunk.prompt_cache_count || 0,
    // The server's own time to the first token: loading, then the prompt's prefill.
    serverTtftMs: (chunk.load_duration + chunk.prompt_eval_duration) / 1e6,
    doneReason: chunk.done_reason,
  };
}
