// Text files attached to a question, as llama.cpp's web UI takes them: each is read here and
// inlined into the message the model gets, under its name, in a code fence longer than any
// run of backticks in it (so the file's own fences cannot end it). The conversation keeps
// them apart from the typed text ({name, text}), so that the page shows them as files.

export const MAX_FILE_BYTES = 1_000_000;

/** A text file's {name, text}; throws, in words, for a binary or too large a file. */
export async function readTextFile(file) {
  if (file.size > MAX_FILE_BYTES) {
    throw new Error(`${file.name} is ${Math.round(file.size / 1000)} kB: text files up to ${MAX_FILE_BYTES / 1000} kB can be attached`);
  }
  const bytes = new Uint8Array(await file.arrayBuffer());
  let text;
  try {
    text = new TextDecoder("utf-8", { fatal: true }).decode(bytes);
  } catch {
    text = null;
  }
  if (text === null || text.includes("\u0000")) {
    throw new Error(`${file.name} is not a text file: only text files can be attached`);
  }
  return { name: file.name, text };
}

function fence(text) {
  const longest = Math.max(2, ...[...text.matchAll(/`+/g)].map((run) => run[0].length));
  return "`".repeat(longest + 1);
}

/** The content the model gets: each file under its name, then the typed text. */
export function withAttachments(text, attachments) {
  const files = attachments.map((file) => {
    const marks = fence(file.text);
    return `${file.name}:\n${marks}\n${file.text}\n${marks}`;
  });
  return [...files, text].filter(Boolean).join("\n\n");
}

export function describeSize(text) {
  const bytes = new TextEncoder().encode(text).length;
  return bytes < 1000 ? `${bytes} B` : `${(bytes / 1000).toFixed(1)} kB`;
}
