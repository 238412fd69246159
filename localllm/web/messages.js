// One message of a conversation as the page shows it. A streaming answer repaints at most once a frame, whatever
// the token rate, so a fast model never lays the page out more often than the screen draws.

import { el, renderMarkdown } from "./render.js";

export function renderMessage(message, { onEdit = null, onRegenerate = null }) {
  const node = el("article", `message ${message.role}`);
  node.append(el("header", "", message.role === "user" ? "You" : message.model || "assistant"));
  const thinking = el("details", "thinking");
  thinking.append(el("summary", "", "Thinking"), el("div", "thought"));
  const body = el("div", "body");
  const figures = el("div", "figures");
  const mark = el("div", "partial");
  node.append(thinking, attachmentsOf(message), body, mark, figures, actionsOf(message, onEdit, onRegenerate));

  let queued = false;
  let startedAt = 0;
  const paint = (final) => {
    thinking.hidden = !message.thinking;
    thinking.lastElementChild.textContent = message.thinking || "";
    if (message.role === "assistant") renderMarkdown(body, message.content, { final });
    else body.textContent = message.content;
    mark.textContent = message.partial ? `Answer ${message.partial}` : "";
    mark.hidden = !message.partial;
    figures.textContent = figuresOf(message);
    if (message.ttftMs !== undefined) node.dataset.ttftMs = message.ttftMs.toFixed(1);
    if (message.stats?.serverTtftMs !== undefined) node.dataset.serverTtftMs = message.stats.serverTtftMs.toFixed(1);
  };
  const frame = () => {
    queued = false;
    const list = node.parentElement;
    const atBottom = list && list.scrollHeight - list.scrollTop - list.clientHeight < 80;
    paint(false);
    if (message.ttftMs === undefined && (message.content || message.thinking)) {
      message.ttftMs = performance.now() - startedAt; // the frame that draws the first token
      node.dataset.ttftMs = message.ttftMs.toFixed(1);
    }
    if (atBottom) list.scrollTop = list.scrollHeight;
  };
  paint(!message.streaming);
  if (message.streaming) node.classList.add("streaming");
  return {
    node,
    update(started) {
      startedAt = started;
      if (!queued) {
        queued = true;
        requestAnimationFrame(frame);
      }
    },
  };
}

function attachmentsOf(message) {
  const row = el("div", "attachments");
  for (const item of message.attachments || []) {
    if (item.kind === "image") {
      const image = el("img", "thumb");
      image.alt = item.name;
      image.src = `data:${item.type || "image/png"};base64,${item.data}`;
      row.append(image);
    } else {
      row.append(el("span", "chip", item.name));
    }
  }
  return row;
}

function actionsOf(message, onEdit, onRegenerate) {
  const row = el("div", "actions");
  const add = (label, action) => {
    const button = el("button", "link", label);
    button.type = "button";
    button.addEventListener("click", action);
    row.append(button);
  };
  if (onEdit) add("Edit", onEdit);
  if (onRegenerate) add("Regenerate", onRegenerate);
  if (message.role === "assistant" && !message.streaming) {
    add("Copy", () => navigator.clipboard?.writeText(message.content));
  }
  return row;
}

function figuresOf(message) {
  const stats = message.stats;
  const parts = [];
  if (stats) {
    parts.push(`${stats.tokens} tokens`);
    if (stats.tokensPerSecond) parts.push(`${stats.tokensPerSecond.toFixed(1)} tokens/s`);
  }
  if (message.ttftMs !== undefined) parts.push(`first token ${Math.round(message.ttftMs)} ms`);
  if (stats) {
    parts.push(`prompt ${stats.promptTokens} tokens, ${stats.cachedTokens} cached`);
    if (stats.doneReason && stats.doneReason !== "stop") parts.push(`ended: ${stats.doneReason}`);
  }
  return parts.join(" · ");
}
