// Settings: saved in localStorage, each left empty meaning "the model's default". (The panel
// opens and closes as panels.js says.)
//
// The model's defaults are its generation_config.json's (the engine reads them and hands
// them to the server; /v1/models shows them as `sampling_defaults`), which the server applies
// to whatever a request leaves out; each field's placeholder shows the value it gets then.
// A model that publishes no temperature gets greedy decoding from this page
// (FALLBACK_TEMPERATURE) instead of the server's 1.0 (vLLM's and OpenAI's): a chat's first
// answer should be the model's likeliest. Small models spread their first token thinly:
// SmolLM2-135M-Instruct, the default model, gives "What is the capital of France?" 15% "The"
// and 14% "L" (a French non-answer follows), so at 0.7, or even 0.2, about half of the
// answers miss Paris, while greedy says "The capital of France is Paris." Anyone who wants
// variety sets a temperature here.
//
// The samplers are those vLLM's chat completions take (top_k, min_p and
// repetition_penalty are vLLM's, the rest OpenAI's). Tools are OpenAI's function
// definitions, sent with every request while they are set.

const KEY = "tandem.settings";
export const FALLBACK_TEMPERATURE = 0;

// name: [element id, request field, what the server uses when the model sets nothing]
const SAMPLERS = {
  temperature: ["temperature", "temperature", `${FALLBACK_TEMPERATURE} (greedy)`],
  topP: ["top-p", "top_p", "1"],
  topK: ["top-k", "top_k", "0 (off)"],
  minP: ["min-p", "min_p", "0 (off)"],
  presencePenalty: ["presence-penalty", "presence_penalty", "0"],
  frequencyPenalty: ["frequency-penalty", "frequency_penalty", "0"],
  repetitionPenalty: ["repetition-penalty", "repetition_penalty", "1 (off)"],
  seed: ["seed", "seed", "random"],
};
const INTEGER = new Set(["top_k", "seed"]);

const $ = (id) => document.getElementById(id);

/** OpenAI's tool list from what the user wrote: a list of tools or of bare functions, or one. */
export function parseTools(text) {
  if (!text.trim()) return [];
  const parsed = JSON.parse(text);
  const list = Array.isArray(parsed) ? parsed : [parsed];
  return list.map((entry, i) => {
    const fn = entry?.type === "function" ? entry.function : entry;
    if (!fn || typeof fn.name !== "string" || !fn.name) throw new Error(`tool ${i + 1} has no name`);
    const tool = { name: fn.name, parameters: fn.parameters ?? { type: "object", properties: {} } };
    if (fn.description) tool.description = String(fn.description);
    return { type: "function", function: tool };
  });
}

export class Settings {
  constructor(onChange) {
    this.onChange = onChange;
    this.fields = {
      systemPrompt: $("system-prompt"),
      ...Object.fromEntries(Object.entries(SAMPLERS).map(([name, [id]]) => [name, $(id)])),
      maxTokens: $("max-tokens"),
      stop: $("stop-strings"),
      tools: $("tools"),
      apiKey: $("api-key"),
      jsonMode: $("json-mode"),
      theme: $("theme"),
    };
    this.defaultsNote = $("defaults-note");
    this.toolsNote = $("tools-note");
    this.modelDefaults = {};
    this.tools = [];
    this.load();
    this.readTools();
    for (const [name, field] of Object.entries(this.fields)) {
      field.addEventListener("change", () => {
        if (name === "tools") this.readTools();
        this.save();
        this.onChange(name);
      });
    }
    $("reset-settings").addEventListener("click", () => {
      for (const name of [...Object.keys(SAMPLERS), "maxTokens", "stop"]) this.fields[name].value = "";
      this.fields.jsonMode.checked = false;
      this.save();
    });
  }

  load() {
    let saved = {};
    try {
      saved = JSON.parse(localStorage.getItem(KEY) || "{}");
    } catch {
      localStorage.removeItem(KEY);
    }
    for (const [name, field] of Object.entries(this.fields)) {
      if (field.type === "checkbox") field.checked = saved[name] === true;
      else if (typeof saved[name] === "string") field.value = saved[name];
    }
  }

  save() {
    const values = {};
    for (const [name, field] of Object.entries(this.fields)) {
      values[name] = field.type === "checkbox" ? field.checked : field.value;
    }
    localStorage.setItem(KEY, JSON.stringify(values));
  }

  // The tools as written, checked: a mistake is shown under the field and no tools are sent.
  readTools() {
    try {
      this.tools = parseTools(this.fields.tools.value);
      this.toolsNote.classList.remove("error");
      this.toolsNote.textContent = this.tools.length
        ? `Sent with every question: ${this.tools.map((tool) => tool.function.name).join(", ")}.`
        : "";
    } catch (error) {
      this.tools = [];
      this.toolsNote.classList.add("error");
      this.toolsNote.textContent = `Not sent: ${error.message}`;
    }
  }

  get apiKey() {
    return this.fields.apiKey.value;
  }

  get theme() {
    return this.fields.theme.value;
  }

  set theme(value) {
    this.fields.theme.value = value;
    this.save();
  }

  get jsonMode() {
    return this.fields.jsonMode.checked;
  }

  /** The model's sampling defaults (its card's `sampling_defaults`), shown as placeholders. */
  setModelDefaults(defaults) {
    this.modelDefaults = defaults ?? {};
    for (const [name, [, field, fallback]] of Object.entries(SAMPLERS)) {
      const value = this.modelDefaults[field];
      this.fields[name].placeholder = value === undefined ? fallback : `${value} (model's)`;
    }
    const maxTokens = this.modelDefaults.max_tokens;
    this.fields.maxTokens.placeholder = maxTokens === undefined ? "rest of the context" : `${maxTokens} (model's)`;
    const known = Object.entries(this.modelDefaults).map(([name, value]) => `${name} ${value}`);
    this.defaultsNote.textContent = known.length
      ? `The model's defaults: ${known.join(", ")}. Empty fields use them.`
      : "The model sets no sampling defaults: empty fields mean greedy decoding and the whole context.";
  }

  /** The sampling fields of a chat request: what is set here, else the model's own. */
  requestFields() {
    const fields = {};
    for (const [name, [, field]] of Object.entries(SAMPLERS)) {
      const text = this.fields[name].value.trim();
      if (text === "") continue; // left out: the server applies the model's default
      fields[field] = INTEGER.has(field) ? parseInt(text, 10) : Number(text);
    }
    if (fields.temperature === undefined && this.modelDefaults.temperature === undefined) {
      fields.temperature = FALLBACK_TEMPERATURE;
    }
    const maxTokens = parseInt(this.fields.maxTokens.value, 10);
    if (maxTokens > 0) fields.max_tokens = maxTokens;
    const stop = this.fields.stop.value.split("\n").filter((line) => line !== "");
    if (stop.length) fields.stop = stop;
    if (this.jsonMode) fields.response_format = { type: "json_object" };
    if (this.tools.length) fields.tools = this.tools;
    return fields;
  }

  systemMessage() {
    const text = this.fields.systemPrompt.value.trim();
    return text ? [{ role: "system", content: text }] : [];
  }
}
