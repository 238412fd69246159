// MCP prompts and resources in the page, when the server runs with `serve --mcp` (server/mcp_routes.py), as the
// other chats have them: the MCP picker beside Attach lists the servers' prompts and resources. A resource is
// attached to the next message as context (a chip, as a text file is); a prompt is written as `/prompt NAME ARGS`
// (values in order, or NAME=VALUE) and sends its messages. `/resource URI` attaches one by hand.

import { call, getJson } from "./api.js";
import { el } from "./render.js";

let prompts = []; // what GET /api/mcp/prompts listed: [] when MCP is off on the server
let resources = [];

// Ask the server for its prompts and resources and fill the picker (hidden when there are none).
export async function loadContext(picker) {
  const listed = (path, key) => getJson(path).then((body) => body[key], () => []);
  [prompts, resources] = await Promise.all([
    listed("/api/mcp/prompts", "prompts"),
    listed("/api/mcp/resources", "resources"),
  ]);
  const options = [el("option", "", "MCP…")];
  options[0].value = "";
  for (const p of prompts) {
    const names = p.arguments.map((name) => (p.required.includes(name) ? name : `${name}?`)).join(" ");
    options.push(option(`prompt:${p.name}`, `Prompt: ${p.name} ${names}`, p.description));
  }
  for (const r of resources) options.push(option(`resource:${r.uri}`, `Resource: ${r.uri}`, r.name));
  picker.replaceChildren(...options);
  picker.hidden = options.length === 1;
}

function option(value, label, title) {
  const node = el("option", "", label);
  node.value = value;
  node.title = title || "";
  return node;
}

// `/prompt …` or `/resource …` typed in the composer, as {kind, rest}; null for any other message.
export function mcpCommand(text) {
  const match = /^\/(prompt|resource)(?:\s+([\s\S]*))?$/.exec(text.trim());
  return match ? { kind: match[1], rest: (match[2] || "").trim() } : null;
}

// A prompt's messages, [{role, content}], from its name and the rest of the line as typed.
export async function promptMessages(rest) {
  const name = rest.split(/\s+/)[0];
  if (!name) throw new Error(`/prompt needs a name: ${prompts.map((p) => p.name).join(", ") || "the servers offer none"}`);
  const line = rest.slice(name.length).trim();
  const response = await call("/api/mcp/prompt", { method: "POST", body: { name, line } });
  return (await response.json()).messages;
}

// A resource as an attachment for the next message (its text bounded by the server).
export async function resourceAttachment(uri) {
  if (!uri) throw new Error(`/resource needs a URI: ${resources.map((r) => r.uri).join(", ") || "the servers offer none"}`);
  const response = await call("/api/mcp/resource", { method: "POST", body: { uri } });
  const { text } = await response.json();
  return { kind: "resource", name: uri, text };
}
