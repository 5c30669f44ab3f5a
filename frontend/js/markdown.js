// Markdown for model output and imported conversations: marked parses, KaTeX renders math
// (marked-katex-extension), DOMPurify sanitizes the HTML, highlight.js colours code. All are
// the pinned release files of frontend/vendor/ (scripts/fetch_frontend_vendor.sh), loaded as
// classic scripts before this module, so they are globals here.
//
// Nothing from a model or an import reaches the page but through `toFragment`, whose
// DOMPurify pass drops scripts, event-handler attributes, javascript: URLs, forms, styles
// and remote images (until the user allows them): an answer can format itself, never act,
// restyle the page or call out. The server's Content-Security-Policy (server/web_ui.py)
// stands behind it.

const { marked, markedKatex, DOMPurify, hljs } = window;

// MathML alone: KaTeX's HTML output positions every glyph with a style attribute, which the
// sanitizer drops (and the page's Content-Security-Policy would refuse); the browser lays
// MathML out itself.
marked.use({ gfm: true }, markedKatex({ throwOnError: false, output: "mathml" }));

// What the sanitized HTML may not hold, and why:
// - `style` attributes and elements, and class names but the renderer's own: an answer could
//   otherwise restyle the page or borrow its classes (a full-page fixed link over Send, a
//   fake "session expired" banner);
// - forms and their controls: nothing an answer shows may take input or submit it;
// - frames, objects and media: they fetch and run what they point at;
// - ids, names and data attributes: the page finds its own elements by them;
// - image sources other than `src` (srcset, a table's background): the remote-image gate
//   below only watches `src`.
const PURIFY = {
  RETURN_DOM_FRAGMENT: true,
  ALLOW_DATA_ATTR: false,
  // KaTeX's MathML keeps the TeX source in <semantics><annotation>, which the browser does
  // not draw; without these two the source would show as text beside the formula.
  ADD_TAGS: ["semantics", "annotation"],
  FORBID_TAGS: [
    "style", "link", "meta", "base", "form", "input", "button", "textarea", "select", "option",
    "dialog", "iframe", "frame", "object", "embed", "audio", "video", "source", "track",
    "picture", "image", "use",
  ],
  FORBID_ATTR: ["style", "id", "name", "srcset", "background", "poster", "ping", "action", "formaction"],
};
// The classes marked and KaTeX write; any other is dropped.
const OWN_CLASS = /^(language-[\w+#.-]+|katex|katex-display|math|math-inline|math-display)$/;

// Set for the duration of one sanitize call (DOMPurify's hooks are global).
let remoteImagesAllowed = false;

/** Whether `url` would be fetched from another host than this page's. */
function isRemote(url) {
  try {
    const parsed = new URL(url, location.href);
    return parsed.protocol !== "data:" && parsed.origin !== location.origin;
  } catch {
    return true;
  }
}

DOMPurify.addHook("uponSanitizeAttribute", (node, data) => {
  if (data.attrName === "class") {
    data.attrValue = data.attrValue.split(/\s+/).filter((name) => OWN_CLASS.test(name)).join(" ");
  }
});

DOMPurify.addHook("afterSanitizeAttributes", (node) => {
  // Links leave the page and tell their target nothing about it.
  if (node.tagName === "A" && node.hasAttribute("href")) {
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer");
  }
  // A remote image loads only where the user allowed it. Its address is taken away here,
  // in the sanitizer's inert document: once the node enters the page, a `src` would fetch.
  if (node.tagName === "IMG" && node.hasAttribute("src")) {
    const src = node.getAttribute("src");
    if (isRemote(src) && !(remoteImagesAllowed && /^https:/i.test(src))) {
      node.removeAttribute("src");
      node.setAttribute("data-blocked-src", src);
    }
  }
});

function toFragment(html, options) {
  remoteImagesAllowed = Boolean(options?.remoteImages);
  let fragment;
  try {
    fragment = DOMPurify.sanitize(html, PURIFY);
  } finally {
    remoteImagesAllowed = false;
  }
  decorate(fragment);
  return fragment;
}

// A blocked remote image becomes a button saying where it would come from; the page asks
// before loading it (app.js: a click allows remote images in that conversation).
function placeholder(img) {
  const src = img.getAttribute("data-blocked-src");
  const button = document.createElement("button");
  button.type = "button";
  button.className = "remote-image small";
  button.dataset.src = src;
  let host = src;
  try {
    host = new URL(src, location.href).host || src;
  } catch {
    // not a URL: shown as written
  }
  const alt = img.getAttribute("alt");
  button.textContent = `Image${alt ? ` “${alt}”` : ""} from ${host}: click to load`;
  button.title = /^https:/i.test(src) ? src : `${src} (only https images can load)`;
  return button;
}

// Code blocks get their language's colours, a language label and a copy button; tables and
// display math scroll sideways on their own instead of widening the page on a phone.
function decorate(root) {
  // KaTeX ends a function's name (log, sin) with U+2061, to which Chromium's MathML gives no
  // space: "n log n" would read "nlogn". Thin spaces around the name, as TeX puts there.
  for (const mo of root.querySelectorAll("mo")) {
    if (mo.textContent !== "\u2061") continue;
    mo.setAttribute("rspace", "0.1667em");
    const name = mo.previousElementSibling;
    const before = name?.previousElementSibling;
    if (before && before.textContent !== "\u2061") {
      const space = document.createElementNS("http://www.w3.org/1998/Math/MathML", "mspace");
      space.setAttribute("width", "0.1667em");
      name.before(space);
    }
  }
  for (const img of root.querySelectorAll("img[data-blocked-src]")) img.replaceWith(placeholder(img));
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

/** The sanitized DOM of a whole markdown text; `options.remoteImages`: load https images. */
export function renderMarkdown(text, options) {
  return toFragment(marked.parse(text), options);
}

/** A streamed answer's text, rendered at most once an animation frame: subclasses render
 * `source` into `container` (and set `frame` back to 0 as they start). */
class FrameRenderer {
  constructor(container) {
    this.container = container;
    this.source = "";
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
export class StreamingMarkdown extends FrameRenderer {
  constructor(container, options) {
    super(container);
    this.options = options;
    this.done = 0; // source characters in finished blocks
    this.links = Object.create(null);
    this.open = document.createElement("div");
    this.open.className = "open-block";
    this.container.replaceChildren(this.open);
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
      this.open.before(toFragment(marked.parser(finished), this.options));
      this.done += finishedSource.length;
      this.open.replaceChildren(toFragment(marked.parser(tokens.slice(open)), this.options));
    } else {
      this.open.replaceChildren(toFragment(marked.parser(tokens), this.options));
    }
  }
}

/** A JSON-mode answer as a highlighted code block: indented where it parses, else (cut off,
 * or still streaming) as it came. */
export function renderJson(text) {
  let shown = text;
  try {
    shown = JSON.stringify(JSON.parse(text), null, 2);
  } catch {
    // not whole JSON (yet): shown as written
  }
  const pre = document.createElement("pre");
  const code = document.createElement("code");
  code.className = "language-json";
  code.textContent = shown;
  pre.append(code);
  const fragment = document.createDocumentFragment();
  fragment.append(pre);
  decorate(fragment);
  return fragment;
}

/** A streaming JSON-mode answer: rendered whole, at most once an animation frame (JSON
 * answers are short, and indenting needs the whole text). */
export class StreamingJson extends FrameRenderer {
  render() {
    this.frame = 0;
    this.container.replaceChildren(renderJson(this.source));
  }
}
