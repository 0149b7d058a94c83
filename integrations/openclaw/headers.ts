// Pure parts of the plugin: which headers one model request carries, and the per-session run
// table that tells a request which kind of run (user, heartbeat, memory, cron) it belongs to.
// No module-level mutable state: each plugin instance owns its RunTable, and a request reads
// only the entry of its own session id.

/** Prefix of every proxy session id this plugin (and the proxy's footer rule) derives. */
export const SESSION_PREFIX = "openclaw:";

/** OpenClaw run triggers whose model calls are housekeeping, never training data. */
export const SIDE_TRIGGERS: ReadonlySet<string> = new Set(["heartbeat", "memory", "cron"]);

/** session_end reasons after which the conversation is over (not shutdown, restart, compaction). */
export const ENDING_REASONS: ReadonlySet<string> = new Set(["new", "reset", "idle", "daily", "deleted"]);

/** The proxy session id of an OpenClaw session id: `openclaw:<sessionId>`. */
export function proxySessionId(sessionId: string): string {
  return SESSION_PREFIX + sessionId;
}

/**
 * Headers to add to one request of session `sessionId` (undefined: OpenClaw gave none, so the
 * request goes out unchanged and the proxy's own rules decide). `trigger` is the run's trigger.
 */
export function requestHeaders(sessionId: string | undefined, trigger: string | undefined,
                               side = false): Record<string, string> {
  const out: Record<string, string> = {};
  if (sessionId) out["X-Session-Id"] = proxySessionId(sessionId);
  if (side || (trigger !== undefined && SIDE_TRIGGERS.has(trigger))) out["X-Turn-Type"] = "side";
  return out;
}

type Run = { runId: string | undefined; trigger: string | undefined };

/**
 * Trigger of the run in flight per OpenClaw session id, bounded (oldest entries dropped).
 * OpenClaw runs one agent run at a time per session (heartbeats and cron wait while the session
 * is busy), so a session's entry belongs to the run whose requests read it.
 */
export class RunTable {
  private readonly runs = new Map<string, Run>();
  private readonly limit: number;

  constructor(limit = 4096) {
    this.limit = limit;
  }

  /** A run of `sessionId` starts (before its first model request). */
  start(sessionId: string, runId: string | undefined, trigger: string | undefined): void {
    this.runs.delete(sessionId);
    this.runs.set(sessionId, { runId, trigger });
    while (this.runs.size > this.limit) {
      const oldest = this.runs.keys().next().value;
      if (oldest === undefined) break;
      this.runs.delete(oldest);
    }
  }

  /** The trigger of the run in flight in `sessionId` (undefined when none is known). */
  trigger(sessionId: string | undefined): string | undefined {
    return sessionId === undefined ? undefined : this.runs.get(sessionId)?.trigger;
  }

  /** A run ended: forget it unless a newer run of the same session replaced it. */
  end(sessionId: string | undefined, runId: string | undefined): void {
    if (sessionId === undefined) return;
    const run = this.runs.get(sessionId);
    if (run !== undefined && (runId === undefined || run.runId === runId)) this.runs.delete(sessionId);
  }

  get size(): number {
    return this.runs.size;
  }
}

/** `POST <baseUrl>/sessions/<id>/end` of the proxy (baseUrl ends with /v1). */
export function sessionEndUrl(baseUrl: string, sessionId: string): string {
  return `${baseUrl.replace(/\/+$/, "")}/sessions/${encodeURIComponent(proxySessionId(sessionId))}/end`;
}

/**
 * Sessions whose compaction is in flight (`before_compaction` .. `after_compaction`), with the
 * time it started. OpenClaw's summarisation calls carry no `sessionId` in their options: while
 * exactly one compaction runs in this process, such a call is that session's (a side turn);
 * with none or several it goes out with `X-Turn-Type: side` only, and the proxy also recognises
 * it from its prompt. An entry older than `maxAgeMs` is ignored (a failed compaction emits no
 * `after_compaction`).
 */
export class Compactions {
  private readonly started = new Map<string, number>();
  private readonly maxAgeMs: number;
  private readonly now: () => number;

  constructor(maxAgeMs = 15 * 60_000, now: () => number = Date.now) {
    this.maxAgeMs = maxAgeMs;
    this.now = now;
  }

  begin(sessionId: string | undefined): void {
    if (sessionId) this.started.set(sessionId, this.now());
  }

  end(sessionId: string | undefined): void {
    if (sessionId) this.started.delete(sessionId);
  }

  /** How many sessions compact now (entries past their time dropped). */
  count(): number {
    const now = this.now();
    for (const [id, t] of this.started) if (now - t > this.maxAgeMs) this.started.delete(id);
    return this.started.size;
  }

  /** The one session compacting now, or undefined (none, or several: not to be told apart). */
  only(): string | undefined {
    return this.count() === 1 ? this.started.keys().next().value : undefined;
  }
}
