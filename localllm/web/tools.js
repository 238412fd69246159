// MCP tools in the page, when the server was started with `serve --mcp`: the tools of its mcp.json servers (run where
// the server runs, through /api/mcp/*), each call shown as a card with its arguments that asks before it runs (run /
// decline / always for this tool) unless the server is trusted, and its result, refusal or error on the card.

import { call, getJson } from "./api.js";
import { el } from "./render.js";

export const MAX_STEPS = 8; // model turns in one answer that may call tools (the last is offered none)
export const DECLINED = "The user declined to run this tool call. Do not call it again; answer without it.";
const STOPPED = "The user stopped this tool call before it finished."; // as mcp/tool_loop.py says it
const SHOWN_RESULT_CHARS = 2000;

let tools = []; // what GET /api/mcp/tools listed: [] when MCP is off on the server
let loading = Promise.resolve(); // the listing under way (it starts the servers: a first answer waits for it)
const always = new Set(); // tools the user said to run without asking, for this page
const deciders = new WeakMap(); // tool message -> the confirm answer's resolver, while its card asks

// Ask the server which tools it offers; MCP off (404) or unreachable means none, quietly.
export function loadTools() {
  loading = getJson("/api/mcp/tools").then(
    (listed) => (tools = listed.tools),
    () => (tools = []),
  );
  return loading;
}

// The tools as a chat request offers them to a model.
export async function offeredTools() {
  await loading;
  return tools.map((t) => ({
    type: "function",
    function: { name: t.name, description: t.description, parameters: t.parameters },
  }));
}

// A call's key, so a turn that only repeats calls already answered can be told apart.
export function callKey(toolCall) {
  return toolCall.function.name + JSON.stringify(toolCall.function.arguments || {});
}

// The tool message a call becomes in the conversation (the card's state lives on it, so a reload shows it).
export function toolMessage(toolCall) {
  const tool = tools.find((t) => t.name === toolCall.function.name);
  return {
    role: "tool",
    tool_name: toolCall.function.name,
    server: tool?.server || "?",
    tool: tool?.tool || toolCall.function.name,
    arguments: toolCall.function.arguments || {},
    status: tool ? "asking" : "error",
    content: tool ? "" : `Error: there is no tool named ${JSON.stringify(toolCall.function.name)}`,
  };
}

// Run a tool message's call once the user agrees (or at once for a trusted server or an "always" tool); the
// message is filled in with what the model will read. `repaint` redraws its card.
export async function runToolMessage(message, repaint, signal) {
  if (message.status !== "asking") return;
  const tool = tools.find((t) => t.name === message.tool_name);
  const trusted = tool.trusted || always.has(message.tool_name);
  const decision = trusted ? "yes" : await ask(message, repaint, signal);
  if (decision === "always") always.add(message.tool_name);
  if (decision === "no") {
    Object.assign(message, { status: "declined", content: DECLINED });
    repaint();
    return;
  }
  message.status = "running";
  repaint();
  let result;
  try {
    // Stop aborts this request; the server sees the page leave and cancels the call on the MCP server.
    const response = await call("/api/mcp/call", {
      method: "POST",
      body: { name: message.tool_name, arguments: message.arguments },
      signal,
    });
    result = await response.json();
  } catch (error) {
    if (error.name !== "AbortError") throw error;
    result = { status: "stopped", text: STOPPED, truncated: false };
  }
  Object.assign(message, { status: result.status, content: result.text, truncated: result.truncated });
  repaint();
}

// The user's answer on the card: yes, no or always; Stop answers no.
function ask(message, repaint, signal) {
  return new Promise((resolve) => {
    const answer = (decision) => {
      deciders.delete(message);
      resolve(decision);
    };
    deciders.set(message, answer);
    signal.addEventListener("abort", () => answer("no"), { once: true });
    repaint();
  });
}

// The card of one tool message: the call, then the confirm buttons or the result.
export function renderToolCard(message) {
  const node = el("article", `message tool ${message.status}`);
  node.append(el("header", "", `${message.server} › ${message.tool}`));
  node.append(el("pre", "arguments", JSON.stringify(message.arguments, null, 2)));
  const decide = deciders.get(message);
  if (message.status === "asking" && decide) {
    const row = el("div", "confirm");
    row.append(el("span", "", "Run this tool?"));
    for (const [label, decision] of [
      ["Run", "yes"],
      ["Decline", "no"],
      ["Always for this tool", "always"],
    ]) {
      const button = el("button", decision === "yes" ? "primary" : "", label);
      button.type = "button";
      button.dataset.decision = decision;
      button.addEventListener("click", () => decide(decision));
      row.append(button);
    }
    node.append(row);
  } else if (message.status === "running") {
    node.append(el("div", "status", "running…"));
  } else if (message.status !== "asking") {
    const labels = { ok: "result", error: "tool error", declined: "declined", stopped: "stopped" };
    const label = labels[message.status] || message.status;
    const cut = message.truncated ? " (cut to the size limit)" : "";
    node.append(el("div", "status", `${label}${cut}`));
    const long = message.content.length > SHOWN_RESULT_CHARS;
    node.append(el("pre", "result", long ? message.content.slice(0, SHOWN_RESULT_CHARS) + "…" : message.content));
  }
  return node;
}
