// OpenClaw plugin of openclaw-pipeline: every model request OpenClaw sends to the pipeline
// provider carries its own OpenClaw session id, so the proxy records one training session per
// OpenClaw conversation.
//
//   X-Session-Id: openclaw:<sessionId>   every request (the id OpenClaw passes to the transport)
//   X-Turn-Type: side                    requests of heartbeat, memory and cron runs, direct
//                                        completions outside an agent run, and calls without a
//                                        session id while a compaction runs (its summaries: they
//                                        get that session's id when only one session compacts)
//   POST <baseUrl>/sessions/openclaw:<sessionId>/end   (X-Session-Done: true) when OpenClaw ends
//                                        or resets a session (session_end: new, reset, idle,
//                                        daily, deleted; not shutdown, restart or compaction)
//
// Headers are computed per request from that request's own options (its sessionId) and the
// trigger of the run in flight in that session (RunTable, owned by this plugin instance): no
// module-level state is shared between concurrent runs.

import { Compactions, ENDING_REASONS, RunTable, requestHeaders, sessionEndUrl } from "./headers.ts";

type Options = { sessionId?: string; headers?: Record<string, string> } & Record<string, unknown>;
type StreamFn = (model: unknown, context: unknown, options?: Options) => unknown;
type WrapContext = { streamFn?: StreamFn };
type AgentContext = { runId?: string; sessionId?: string; trigger?: string };
type ProviderEntry = { baseUrl?: string; apiKey?: unknown };
type Api = {
  config?: { models?: { providers?: Record<string, ProviderEntry> } };
  pluginConfig?: Record<string, unknown>;
  logger?: { warn?: (msg: string) => void; debug?: (msg: string) => void };
  registerProvider: (provider: Record<string, unknown>) => void;
  on: (hook: string, handler: (event: any, ctx: any) => unknown, opts?: Record<string, unknown>) => void;
};

/** A stream function that adds this request's headers, then calls `inner`. */
function labelled(inner: StreamFn, runs: RunTable, compactions: Compactions, side: boolean): StreamFn {
  return (model, context, options) => {
    let sessionId = typeof options?.sessionId === "string" ? options.sessionId : undefined;
    let housekeeping = side;
    if (sessionId === undefined && compactions.count() > 0) {
      sessionId = compactions.only();  // a summarisation call of the compaction in flight
      housekeeping = true;
    }
    const extra = requestHeaders(sessionId, runs.trigger(sessionId), housekeeping);
    if (Object.keys(extra).length === 0) return inner(model, context, options);
    return inner(model, context, { ...options, headers: { ...options?.headers, ...extra } });
  };
}

/** Tell the proxy that `sessionId` is over (best effort: a failure is logged, never thrown). */
async function endSession(api: Api, providerId: string, sessionId: string): Promise<void> {
  const entry = api.config?.models?.providers?.[providerId];
  if (!entry?.baseUrl) return;
  const headers: Record<string, string> = { "X-Session-Done": "true" };
  if (typeof entry.apiKey === "string" && entry.apiKey) headers.Authorization = `Bearer ${entry.apiKey}`;
  try {
    const res = await fetch(sessionEndUrl(entry.baseUrl, sessionId), {
      method: "POST", headers, signal: AbortSignal.timeout(1500),
    });
    if (!res.ok) api.logger?.warn?.(`openclaw-pipeline-rl: session end answered ${res.status}`);
  } catch (err) {
    api.logger?.warn?.(`openclaw-pipeline-rl: session end failed: ${String(err)}`);
  }
}

export function register(api: Api): void {
  const providerId = typeof api.pluginConfig?.provider === "string" ? api.pluginConfig.provider : "pipeline";
  const runs = new RunTable();
  const compactions = new Compactions();
  api.registerProvider({
    id: providerId,
    label: "openclaw-pipeline proxy",
    auth: [],
    wrapStreamFn: (ctx: WrapContext) => (ctx.streamFn ? labelled(ctx.streamFn, runs, compactions, false) : undefined),
    wrapSimpleCompletionStreamFn: (ctx: WrapContext) =>
      (ctx.streamFn ? labelled(ctx.streamFn, runs, compactions, true) : undefined),
  });
  api.on("before_prompt_build", (_event: unknown, ctx: AgentContext) => {
    if (ctx?.sessionId) runs.start(ctx.sessionId, ctx.runId, ctx.trigger);
    return undefined;
  });
  api.on("agent_end", (event: { runId?: string }, ctx: AgentContext) => {
    runs.end(ctx?.sessionId, event?.runId ?? ctx?.runId);
  });
  api.on("before_compaction", (_event: unknown, ctx: AgentContext) => { compactions.begin(ctx?.sessionId); });
  api.on("after_compaction", (_event: unknown, ctx: AgentContext) => { compactions.end(ctx?.sessionId); });
  api.on("session_end", async (event: { sessionId?: string; reason?: string }) => {
    if (event?.sessionId && ENDING_REASONS.has(event.reason ?? "")) {
      await endSession(api, providerId, event.sessionId);
    }
  });
}

export default {
  id: "openclaw-pipeline-rl",
  name: "openclaw-pipeline RL session headers",
  description: "Labels OpenClaw's requests to the openclaw-pipeline proxy with their session",
  register,
};
