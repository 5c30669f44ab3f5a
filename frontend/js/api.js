// The server's HTTP API as the page uses it: the model card, the engine's stats, and chat
// completions streamed over Server-Sent Events.

export class ApiError extends Error {}

// What a failed fetch means: the browser says only "Failed to fetch" or "network error".
const UNREACHABLE = `The server at ${location.host} does not answer: it may have stopped. Start it again, then try once more.`;
const CONNECTION_LOST =
  `The connection to the server at ${location.host} was lost mid-answer: the server may have ` +
  "stopped or restarted. The answer so far is kept.";

/** The server itself did not answer (stopped, or the network is down), as opposed to an error it sent. */
export class ServerUnreachable extends ApiError {}

// fetch() with its network failures (a TypeError) as a ServerUnreachable.
async function request(url, options) {
  try {
    return await fetch(url, options);
  } catch (error) {
    if (error.name === "AbortError" || error.name === "TimeoutError") throw error;
    throw new ServerUnreachable(UNREACHABLE);
  }
}

/** The headers of every API call: the key, when the server wants one (--api-key). */
export function apiHeaders(apiKey, extra = {}) {
  const key = apiKey.trim();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error?.message || `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}

/** The served model's card (id, max_model_len, sampling_defaults). */
export async function fetchModel(apiKey) {
  const response = await request("/v1/models", { headers: apiHeaders(apiKey) });
  if (!response.ok) throw new ApiError(await errorMessage(response));
  return (await response.json()).data[0];
}

/** The engine's state (server/routes/stats.py), or an ApiError when it does not answer. */
export async function fetchStats(signal) {
  const response = await request("/stats", { cache: "no-store", signal });
  if (!response.ok) throw new ApiError(await errorMessage(response));
  return response.json();
}

// Yields the parsed JSON of each `data:` event of an SSE response, until [DONE]. A stream
// that breaks off before [DONE] lost its server.
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    let read;
    try {
      read = await reader.read();
    } catch (error) {
      if (error.name === "AbortError") throw error;
      throw new ServerUnreachable(CONNECTION_LOST);
    }
    const { value, done } = read;
    if (done) throw new ServerUnreachable(CONNECTION_LOST);
    buffer += value.replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).trimStart())
        .join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

/**
 * Streams one chat answer. `onUpdate(answer)` is called as the answer grows, where `answer`
 * is {content, reasoning, toolCalls: [{id, name, arguments}], stats}; the last call has the
 * stats (TTFT and decode speed measured here, token counts from the usage chunk).
 * Aborting `signal` stops it: the server then aborts the request in the engine.
 */
export async function streamChat({ body, apiKey, signal, onUpdate }) {
  const started = performance.now();
  let firstToken = null;
  const answer = { content: "", reasoning: "", toolCalls: [], stats: null };
  let usage = null;
  let finishReason = null;
  const finishStats = (reason) => {
    const ended = performance.now();
    const completion = usage?.completion_tokens ?? null;
    // Decode speed: the tokens after the first, over the time after the first.
    const decodeSeconds = firstToken === null ? 0 : (ended - firstToken) / 1000;
    answer.stats = {
      ttft: firstToken === null ? null : (firstToken - started) / 1000,
      tokensPerSecond: completion > 1 && decodeSeconds > 0 ? (completion - 1) / decodeSeconds : null,
      promptTokens: usage?.prompt_tokens ?? null,
      completionTokens: completion,
      finishReason: reason,
    };
  };
  try {
    const response = await request("/v1/chat/completions", {
      method: "POST",
      headers: apiHeaders(apiKey, { "Content-Type": "application/json" }),
      body: JSON.stringify(body),
      signal,
    });
    if (!response.ok) throw new ApiError(await errorMessage(response));
    for await (const chunk of events(response)) {
      if (chunk.error) throw new ApiError(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices?.[0];
      if (!choice) continue;
      if (choice.finish_reason) finishReason = choice.finish_reason;
      const delta = choice.delta ?? {};
      if (!delta.content && !delta.reasoning_content && !delta.tool_calls) continue;
      if (firstToken === null) firstToken = performance.now();
      if (delta.content) answer.content += delta.content;
      if (delta.reasoning_content) answer.reasoning += delta.reasoning_content;
      for (const call of delta.tool_calls ?? []) {
        // OpenAI's streamed tool calls: the first delta of an index names it, the rest
        // append to its arguments.
        const slot = (answer.toolCalls[call.index ?? 0] ??= { id: "", name: "", arguments: "" });
        if (call.id) slot.id = call.id;
        if (call.function?.name) slot.name += call.function.name;
        if (call.function?.arguments) slot.arguments += call.function.arguments;
      }
      onUpdate(answer);
    }
    finishStats(finishReason);
  } catch (error) {
    if (error.name !== "AbortError") throw Object.assign(error, { answer });
    finishStats("stopped");
  }
  onUpdate(answer);
  return answer;
}
