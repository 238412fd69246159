// Model text into the page. Model output is untrusted: markdown is parsed by marked, and the HTML it gives is
// sanitised by DOMPurify before it touches the DOM (a raw <script> or an onerror= attribute in an answer is dropped).
// Names and everything else the page shows as plain text go in through textContent.

import { marked } from "./vendor/marked.esm.js";
import DOMPurify from "./vendor/purify.es.mjs";
import hljs from "./vendor/highlight/core.min.js";
import bash from "./vendor/highlight/languages/bash.min.js";
import c from "./vendor/highlight/languages/c.min.js";
import cpp from "./vendor/highlight/languages/cpp.min.js";
import css from "./vendor/highlight/languages/css.min.js";
import diff from "./vendor/highlight/languages/diff.min.js";
import go from "./vendor/highlight/languages/go.min.js";
import java from "./vendor/highlight/languages/java.min.js";
import javascript from "./vendor/highlight/languages/javascript.min.js";
import json from "./vendor/highlight/languages/json.min.js";
import markdown from "./vendor/highlight/languages/markdown.min.js";
import python from "./vendor/highlight/languages/python.min.js";
import rust from "./vendor/highlight/languages/rust.min.js";
import shell from "./vendor/highlight/languages/shell.min.js";
import sql from "./vendor/highlight/languages/sql.min.js";
import typescript from "./vendor/highlight/languages/typescript.min.js";
import xml from "./vendor/highlight/languages/xml.min.js";
import yaml from "./vendor/highlight/languages/yaml.min.js";

const LANGUAGES = { bash, c, cpp, css, diff, go, java, javascript, json, markdown, python, rust, shell, sql };
Object.assign(LANGUAGES, { typescript, xml, yaml });
for (const [name, grammar] of Object.entries(LANGUAGES)) hljs.registerLanguage(name, grammar);

marked.setOptions({ gfm: true, breaks: false });

// Links a model writes open in a new tab, never with access to this page.
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A") {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});

export function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

export function sanitizedHtml(text) {
  return DOMPurify.sanitize(marked.parse(text), { FORBID_TAGS: ["style", "form", "input"] });
}

// The answer's markdown into `target`. While it streams only the text is laid out; code is highlighted and given
// its copy button once the answer is whole.
export function renderMarkdown(target, text, { final = true } = {}) {
  target.innerHTML = sanitizedHtml(text);
  if (final) target.querySelectorAll("pre > code").forEach(decorateCode);
}

function decorateCode(code) {
  const language = /language-([\w-]+)/.exec(code.className)?.[1];
  if (language && hljs.getLanguage(language)) hljs.highlightElement(code);
  const copy = el("button", "copy", "Copy");
  copy.type = "button";
  copy.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(code.textContent);
      copy.textContent = "Copied";
    } catch {
      // No clipboard outside a secure context (plain http from another machine): select the text instead.
      window.getSelection().selectAllChildren(code);
      copy.textContent = "Selected: press Ctrl+C";
    }
    setTimeout(() => (copy.textContent = "Copy"), 1500);
  });
  code.parentElement.classList.add("code");
  code.parentElement.prepend(copy);
}

export function formatBytes(n) {
  if (!n) return "0 B";
  const units = ["B", "KB", "MB", "GB", "TB"];
  const power = Math.min(Math.floor(Math.log(n) / Math.log(1024)), units.length - 1);
  return `${(n / 1024 ** power).toFixed(power ? 1 : 0)} ${units[power]}`;
}
