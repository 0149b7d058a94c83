// Unit tests of the plugin against a recording stand-in of OpenClaw's plugin API and a real
// local HTTP server as the proxy's session-end endpoint. Run: node --test plugin.test.ts
// (Node >= 24 runs TypeScript directly; tests/e2e/test_openclaw_plugin.py runs it in the suite).

import assert from "node:assert/strict";
import { createServer } from "node:http";
import type { AddressInfo } from "node:net";
import { test } from "node:test";

import { Compactions, RunTable, requestHeaders, sessionEndUrl } from "./headers.ts";
import plugin from "./index.ts";

type Handler = (event: any, ctx: any) => unknown;

function load(baseUrl = "http://127.0.0.1:9/v1") {
  const hooks = new Map<string, Handler[]>();
  let provider: any;
  plugin.register({
    config: { models: { providers: { pipeline: { baseUrl, apiKey: "k" } } } },
    registerProvider: (p) => { provider = p; },
    on: (name, handler) => { hooks.set(name, [...(hooks.get(name) ?? []), handler]); },
  });
  const seen: any[] = [];
  const inner = (_m: unknown, _c: unknown, options?: any) => { seen.push(options); return "stream"; };
  const fire = async (name: string, event: any, ctx: any) => {
    for (const h of hooks.get(name) ?? []) await h(event, ctx);
  };
  return { provider, seen, inner, fire };
}

test("every request carries its own session id; user runs are main", () => {
  const { provider, seen, inner } = load();
  const stream = provider.wrapStreamFn({ streamFn: inner });
  assert.equal(stream("m", "c", { sessionId: "s1", headers: { "x-keep": "1" } }), "stream");
  assert.deepEqual(seen[0].headers, { "x-keep": "1", "X-Session-Id": "openclaw:s1" });
  assert.equal(provider.id, "pipeline");
});

test("heartbeat, memory and cron runs are side turns, and runs of other sessions do not cross", async () => {
  const { provider, seen, inner, fire } = load();
  const stream = provider.wrapStreamFn({ streamFn: inner });
  await fire("before_prompt_build", {}, { sessionId: "a", runId: "r1", trigger: "user" });
  await fire("before_prompt_build", {}, { sessionId: "b", runId: "r2", trigger: "heartbeat" });
  stream("m", "c", { sessionId: "a" });
  stream("m", "c", { sessionId: "b" });
  assert.equal(seen[0].headers["X-Turn-Type"], undefined);
  assert.equal(seen[1].headers["X-Turn-Type"], "side");
  for (const trigger of ["memory", "cron"]) {
    await fire("before_prompt_build", {}, { sessionId: "c", runId: trigger, trigger });
    stream("m", "c", { sessionId: "c" });
    assert.equal(seen.at(-1).headers["X-Turn-Type"], "side", trigger);
  }
  // the end of an older run does not clear the newer run of the same session
  await fire("agent_end", { runId: "memory" }, { sessionId: "c" });
  stream("m", "c", { sessionId: "c" });
  assert.equal(seen.at(-1).headers["X-Turn-Type"], "side");
  await fire("agent_end", { runId: "cron" }, { sessionId: "c" });
  stream("m", "c", { sessionId: "c" });
  assert.equal(seen.at(-1).headers["X-Turn-Type"], undefined);
});

test("a request without a session id goes out unchanged; direct completions are side", () => {
  const { provider, seen, inner } = load();
  const opts = { temperature: 1 };
  provider.wrapStreamFn({ streamFn: inner })("m", "c", opts);
  assert.equal(seen[0], opts);
  provider.wrapSimpleCompletionStreamFn({ streamFn: inner })("m", "c", { sessionId: "s" });
  assert.deepEqual(seen[1].headers, { "X-Session-Id": "openclaw:s", "X-Turn-Type": "side" });
  assert.equal(provider.wrapStreamFn({}), undefined);
});

test("a call without a session id during one session's compaction is that session's side turn", async () => {
  const { provider, seen, inner, fire } = load();
  const stream = provider.wrapStreamFn({ streamFn: inner });
  await fire("before_compaction", { messageCount: 9 }, { sessionId: "a" });
  stream("m", "c", {});
  assert.deepEqual(seen[0].headers, { "X-Session-Id": "openclaw:a", "X-Turn-Type": "side" });
  stream("m", "c", { sessionId: "a" });  // the agent's own call keeps its id and is not side
  assert.deepEqual(seen[1].headers, { "X-Session-Id": "openclaw:a" });
  await fire("before_compaction", { messageCount: 9 }, { sessionId: "b" });
  stream("m", "c", {});  // two compactions at once: no id, still side
  assert.deepEqual(seen[2].headers, { "X-Turn-Type": "side" });
  await fire("after_compaction", {}, { sessionId: "a" });
  await fire("after_compaction", {}, { sessionId: "b" });
  const opts = { temperature: 1 };
  stream("m", "c", opts);  // no compaction: unchanged
  assert.equal(seen[3], opts);
});

test("a compaction that never ended is forgotten after its time", () => {
  let now = 0;
  const c = new Compactions(1000, () => now);
  c.begin("a");
  assert.equal(c.only(), "a");
  now = 1001;
  assert.equal(c.only(), undefined);
  assert.equal(c.count(), 0);
});

test("ending or resetting a session ends it at the proxy; a shutdown does not", async () => {
  const calls: { url?: string; method?: string; headers: any }[] = [];
  const server = createServer((req, res) => {
    calls.push({ url: req.url, method: req.method, headers: req.headers });
    res.writeHead(200, { "content-type": "application/json" }).end("{}");
  });
  await new Promise<void>((ok) => server.listen(0, "127.0.0.1", ok));
  try {
    const port = (server.address() as AddressInfo).port;
    const { fire } = load(`http://127.0.0.1:${port}/v1`);
    await fire("session_end", { sessionId: "s1", reason: "shutdown" }, {});
    await fire("session_end", { sessionId: "s1", reason: "compaction" }, {});
    assert.equal(calls.length, 0);
    await fire("session_end", { sessionId: "s1", reason: "reset" }, {});
    await fire("session_end", { sessionId: "s2", reason: "new" }, {});
    assert.deepEqual(calls.map((c) => [c.method, c.url]), [
      ["POST", "/v1/sessions/openclaw%3As1/end"], ["POST", "/v1/sessions/openclaw%3As2/end"]]);
    assert.equal(calls[0].headers["x-session-done"], "true");
    assert.equal(calls[0].headers.authorization, "Bearer k");
  } finally {
    server.close();
  }
});

test("a proxy that is down does not make session_end throw", async () => {
  const { fire } = load("http://127.0.0.1:9/v1");
  await fire("session_end", { sessionId: "s1", reason: "reset" }, {});
});

test("pure helpers", () => {
  assert.deepEqual(requestHeaders(undefined, "heartbeat"), { "X-Turn-Type": "side" });
  assert.deepEqual(requestHeaders("x", "user"), { "X-Session-Id": "openclaw:x" });
  assert.equal(sessionEndUrl("http://h:1/v1/", "a b"), "http://h:1/v1/sessions/openclaw%3Aa%20b/end");
  const t = new RunTable(2);
  t.start("a", "1", "cron");
  t.start("b", "2", "user");
  t.start("c", "3", "user");
  assert.equal(t.size, 2);
  assert.equal(t.trigger("a"), undefined);
  assert.equal(t.trigger("b"), "user");
});
