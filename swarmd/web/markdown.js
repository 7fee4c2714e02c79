// A small Markdown renderer for model replies: no network, no dependencies.
// Everything is HTML-escaped first, so a reply can never inject markup; then fenced code
// blocks, headings, lists, quotes and paragraphs, and inline code, bold, italics and
// http(s) links. A <think>...</think> block becomes a collapsed <details>.
"use strict";

const Markdown = (() => {
  const escapeHtml = (text) =>
    text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;").replace(/'/g, "&#39;");

  function inline(text) {
    const codes = [];
    let out = text.replace(/`([^`\n]+)`/g, (_, code) => {
      codes.push(code);
      return `\u0000${codes.length - 1}\u0000`;
    });
    out = out
      .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|[\s(])\*([^*\n]+)\*(?=[\s).,!?:;]|$)/g, "$1<em>$2</em>")
      .replace(/\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/g,
        '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>');
    return out.replace(/\u0000(\d+)\u0000/g, (_, i) => `<code>${codes[Number(i)]}</code>`);
  }

  function codeBlock(lang, body) {
    const label = lang ? `<span class="lang">${lang}</span>` : "";
    return `<div class="code">${label}<button type="button" class="copy-code">Copy</button>` +
      `<pre><code>${body}</code></pre></div>`;
  }

  function blocks(text) {
    const lines = text.split("\n");
    const html = [];
    let para = [];
    let list = null; // {tag, items}
    const flushPara = () => {
      if (para.length) html.push(`<p>${inline(para.join("<br>"))}</p>`);
      para = [];
    };
    const flushList = () => {
      if (list) html.push(`<${list.tag}>${list.items.map((i) => `<li>${inline(i)}</li>`).join("")}</${list.tag}>`);
      list = null;
    };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      const fence = line.match(/^```\s*([\w+-]*)\s*$/);
      if (fence) {
        flushPara(); flushList();
        const body = [];
        i++;
        while (i < lines.length && !/^```\s*$/.test(lines[i])) body.push(lines[i++]);
        html.push(codeBlock(fence[1], body.join("\n")));
        continue;
      }
      const heading = line.match(/^(#{1,4})\s+(.*)$/);
      const bullet = line.match(/^\s*[-*+]\s+(.*)$/);
      const numbered = line.match(/^\s*\d+[.)]\s+(.*)$/);
      if (heading) {
        flushPara(); flushList();
        const level = heading[1].length + 2; // h3..h6 inside a message
        html.push(`<h${level}>${inline(heading[2])}</h${level}>`);
      } else if (bullet || numbered) {
        flushPara();
        const tag = bullet ? "ul" : "ol";
        if (!list || list.tag !== tag) { flushList(); list = { tag, items: [] }; }
        list.items.push((bullet || numbered)[1]);
      } else if (/^&gt;\s?/.test(line)) {
        flushPara(); flushList();
        html.push(`<blockquote>${inline(line.replace(/^&gt;\s?/, ""))}</blockquote>`);
      } else if (!line.trim()) {
        flushPara(); flushList();
      } else {
        flushList();
        para.push(line);
      }
    }
    flushPara(); flushList();
    return html.join("");
  }

  function render(text) {
    const safe = escapeHtml(text);
    // Reasoning first: an open <think> without its end (still streaming) is shown too.
    const think = safe.match(/^\s*&lt;think&gt;([\s\S]*?)(&lt;\/think&gt;|$)([\s\S]*)$/);
    if (think) {
      const reasoning = `<details class="think"><summary>Reasoning</summary>${blocks(think[1].trim())}</details>`;
      return reasoning + blocks(think[3]);
    }
    return blocks(safe);
  }

  return { render, escapeHtml };
})();
