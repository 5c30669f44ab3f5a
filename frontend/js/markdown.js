// Markdown for model output and imported conversations: marked parses, KaTeX renders math
// (marked-katex-extension), DOMPurify sanitizes the HTML, highlight.js colours code. All are
// the pinned release files of frontend/vendor/ (scripts/fetch_frontend_vendor.sh), loaded as
// classic scripts before this module, so they are globals here.
//
// Nothing from a model or an import reaches the page but through `toFragment`, whose
// DOMPurify pass drops scripts, event-handler attributes, javascript: URLs, forms and style
// sheets: an answer can format itself, never act.

const { marked, markedKatex, DOMPurify, hljs } = window;

marked.use({ gfm: true }, markedKatex({ throwOnError: false }));

// Links leave the page; nothing a model writes may be a form or restyle the page.
DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
});
const PURIFY = {
  RETURN_DOM_FRAGMENT: true,
  FORBID_TAGS: ["style", "form", "input", "button", "textarea", "select", "dialog"],
};

function toFragment(html) {
  const fragment = DOMPurify.sanitize(html, PURIFY);
  decorate(fragment);
  return fragment;
}

// Code blocks get their language's colours, a language label and a copy button; tables and
// display math scroll sideways on their own instead of widening the page on a phone.
function decorate(root) {
  for (const code of root.querySelectorAll("pre > code")) {
    const language = [...code.classList].find((name) => name.startsWith("language-"))?.slice(9);
    if (language && hljs.getLanguage(language)) hljs.highlightElement(code);
    const pre = code.parentElement;
    const block = document.createElement("div");
    block.className = "code-block";
    const head = document.createElement("div");
    head.className = "code-head";
    const label = document.createElement("span");
    label.className = "code-lang";
    label.textContent = language || "text";
    const copy = document.createElement("button");
    copy.type = "button";
    copy.className = "copy-code small";
    copy.textContent = "Copy";
    copy.setAttribute("aria-label", `Copy ${language || "text"} code`);
    head.append(label, copy);
    pre.replaceWith(block);
    block.append(head, pre);
  }
  for (const table of root.querySelectorAll("table")) {
    const wrap = document.createElement("div");
    wrap.className = "table-wrap";
    table.replaceWith(wrap);
    wrap.append(table);
  }
}

/** The sanitized DOM of a whole markdown text. */
export function renderMarkdown(text) {
  return toFragment(marked.parse(text));
}

// Streaming without flicker or quadratic work.
//
// Re-parsing the whole answer on every token would cost O(n) per token, O(n²) per answer,
// and replacing all of its DOM would flash and lose text selections. Markdown is a sequence
// of blocks (paragraphs, lists, code fences, tables…), and once the text goes on past a
// block, that block cannot change any more. So the answer is kept as two parts:
//   - finished blocks, rendered once and appended as DOM that is never touched again;
//   - the open block (the last one, which the next tokens may still extend), the only text
//     lexed again, and the only DOM replaced.
// marked's lexer gives each block token its `raw` source, and the raws of a text's tokens
// concatenate to the text, so `done` (how much source the finished blocks hold) moves past
// every block but the last. Renders are also batched to one per animation frame, so a fast
// stream lexes at most once a frame whatever its token rate. A long code block stays open
// until its fence closes: only it is re-lexed, which is linear per frame, not per answer.
// Reference links defined in a finished block still resolve later (`links` keeps them); one
// used in a finished block before its definition came stays literal text.
export class StreamingMarkdown {
  constructor(container) {
    this.container = container;
    this.source = "";
    this.done = 0; // source characters in finished blocks
    this.links = Object.create(null);
    this.open = document.createElement("div");
    this.open.className = "open-block";
    this.container.replaceChildren(this.open);
    this.frame = 0;
  }

  /** The whole text so far; rendered at the next animation frame. */
  update(text) {
    this.source = text;
    if (!this.frame) this.frame = requestAnimationFrame(() => this.render());
  }

  /** Renders the last text now: at the end of the stream. */
  finish() {
    if (this.frame) cancelAnimationFrame(this.frame);
    this.render();
  }

  render() {
    this.frame = 0;
    const tail = this.source.slice(this.done);
    // marked resolves reference links as it lexes: the tail's lexer starts with a copy of
    // those defined in finished blocks (the open block's may still be half written).
    const lexer = new marked.Lexer(marked.defaults);
    lexer.tokens.links = Object.assign(Object.create(null), this.links);
    const tokens = lexer.lex(tail);
    let open = tokens.length - 1;
    while (open > 0 && tokens[open].type === "space") open--;
    const finished = tokens.slice(0, Math.max(open, 0));
    const finishedSource = finished.map((token) => token.raw).join("");
    // Only if the lexer's raws are exactly the source (they are; this guards upgrades).
    if (finished.length && tail.startsWith(finishedSource)) {
      for (const { type, tag, href, title } of finished) {
        if (type === "def") this.links[tag] ??= { href, title };
      }
      this.open.before(toFragment(marked.parser(finished)));
      this.done += finishedSource.length;
      this.open.replaceChildren(toFragment(marked.parser(tokens.slice(open))));
    } else {
      this.open.replaceChildren(toFragment(marked.parser(tokens)));
    }
  }
}
