// Settings: saved in localStorage, each left empty meaning "the model's default".
//
// The model's defaults are its generation_config.json's (the engine reads them and hands
// them to the server; /v1/models shows them as `sampling_defaults`), which the server applies
// to whatever a request leaves out. A model that publishes no temperature gets greedy
// decoding from this page (FALLBACK_TEMPERATURE) instead of the server's 1.0 (vLLM's and
// OpenAI's): a chat's first answer should be the model's likeliest. Small models spread
// their first token thinly: SmolLM2-135M-Instruct, the default model, gives "What is the
// capital of France?" 15% "The" and 14% "L" (a French non-answer follows), so at 0.7, or even
// 0.2, about half of the answers miss Paris, while greedy says "The capital of France is
// Paris." Anyone who wants variety sets a temperature here.

const KEY = "tandem.settings";
export const FALLBACK_TEMPERATURE = 0;

const $ = (id) => document.getElementById(id);

export class Settings {
  constructor(onChange) {
    this.onChange = onChange;
    this.fields = {
      systemPrompt: $("system-prompt"),
      temperature: $("temperature"),
      topP: $("top-p"),
      maxTokens: $("max-tokens"),
      apiKey: $("api-key"),
      jsonMode: $("json-mode"),
      theme: $("theme"),
    };
    this.panel = $("settings");
    this.toggleButton = $("toggle-settings");
    this.defaultsNote = $("defaults-note");
    this.modelDefaults = {};
    this.load();
    for (const [name, field] of Object.entries(this.fields)) {
      field.addEventListener("change", () => {
        this.save();
        this.onChange(name);
      });
    }
    this.toggleButton.addEventListener("click", () => this.show(this.panel.hidden));
    $("close-settings").addEventListener("click", () => this.show(false));
    $("reset-settings").addEventListener("click", () => {
      for (const name of ["temperature", "topP", "maxTokens"]) this.fields[name].value = "";
      this.fields.jsonMode.checked = false;
      this.save();
    });
    this.panel.addEventListener("keydown", (event) => {
      if (event.key === "Escape") {
        event.stopPropagation();
        this.show(false);
      }
    });
  }

  show(visible) {
    this.panel.hidden = !visible;
    this.toggleButton.setAttribute("aria-expanded", String(visible));
    (visible ? this.fields.systemPrompt : this.toggleButton).focus();
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

  /** The model's sampling defaults (its card's `sampling_defaults`), shown as placeholders. */
  setModelDefaults(defaults) {
    this.modelDefaults = defaults ?? {};
    const temperature = this.modelDefaults.temperature;
    this.fields.temperature.placeholder =
      temperature === undefined ? `${FALLBACK_TEMPERATURE} (greedy)` : `${temperature} (model's)`;
    const topP = this.modelDefaults.top_p;
    this.fields.topP.placeholder = topP === undefined ? "1" : `${topP} (model's)`;
    const known = Object.entries(this.modelDefaults).map(([name, value]) => `${name} ${value}`);
    this.defaultsNote.textContent = known.length
      ? `The model's defaults: ${known.join(", ")}. Empty fields use them.`
      : "The model sets no sampling defaults: empty fields mean greedy decoding and the whole context.";
  }

  /** The sampling fields of a chat request: what is set here, else the model's own. */
  requestFields() {
    const fields = {};
    const number = (field) => (field.value.trim() === "" ? null : Number(field.value));
    const temperature = number(this.fields.temperature);
    if (temperature !== null) fields.temperature = temperature;
    else if (this.modelDefaults.temperature === undefined) fields.temperature = FALLBACK_TEMPERATURE;
    // else: left out, so the server applies the model's default
    const topP = number(this.fields.topP);
    if (topP !== null) fields.top_p = topP;
    const maxTokens = parseInt(this.fields.maxTokens.value, 10);
    if (maxTokens > 0) fields.max_tokens = maxTokens;
    if (this.fields.jsonMode.checked) fields.response_format = { type: "json_object" };
    return fields;
  }

  systemMessage() {
    const text = this.fields.systemPrompt.value.trim();
    return text ? [{ role: "system", content: text }] : [];
  }
}
