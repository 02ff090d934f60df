// A Node client of mlxserve on code that `buf generate` (buf.gen.yaml: protoc-gen-es) made
// from the .proto, over connect-es's gRPC transport. tests/test_node_client.py copies it next to
// the generated gen/ directory and runs `node generation_client.mjs HOST:PORT`.
//
// It streams one generation to the end, then starts a long one and aborts it mid-stream, and
// prints one JSON object (CacheStats in proto3 JSON) for the Python test to check.
import { create, toJson } from "@bufbuild/protobuf";
import { Code, ConnectError, createClient } from "@connectrpc/connect";
import { createGrpcTransport } from "@connectrpc/connect-node";
import {
  CacheStatsResponseSchema,
  FinishReason,
  GenerationService,
  StreamGenerateRequestSchema,
} from "./gen/es/mlxserve/v1/generation_pb.js";

const target = process.argv[2];
const client = createClient(
  GenerationService,
  createGrpcTransport({ baseUrl: `http://${target}` }),
);
const stats = async () => toJson(CacheStatsResponseSchema, await client.cacheStats({}));
const deadline = (seconds) => ({ timeoutMs: seconds * 1000 });

const before = await stats();

// 1. A chat streamed to its last message.
const streamRequest = create(StreamGenerateRequestSchema, {
  requestId: "node-stream",
  input: {
    case: "chat",
    value: { messages: [{ role: "user", content: "What is the capital of France?" }] },
  },
  stopping: { maxTokens: 12 },
});
const streamed = { text: "", tokenIds: [], messages: 0 };
for await (const message of client.streamGenerate(streamRequest, deadline(120))) {
  streamed.messages += 1;
  streamed.text += message.text;
  streamed.tokenIds.push(...message.tokenIds);
  if (message.finishReason !== FinishReason.UNSPECIFIED) {
    streamed.finishReason = FinishReason[message.finishReason];
    streamed.completionTokens = message.usage?.completionTokens;
  }
}

// 2. A long generation aborted after a few tokens, with CacheStats read while it decodes.
const abort = new AbortController();
const cancelled = { tokens: 0, code: null };
let during = null;
try {
  const longRequest = {
    requestId: "node-cancel",
    input: { case: "text", value: "Once upon a time" },
    stopping: { maxTokens: 400, ignoreEos: true },
  };
  for await (const message of client.streamGenerate(longRequest, {
    signal: abort.signal,
    ...deadline(120),
  })) {
    cancelled.tokens += message.tokenIds.length;
    if (cancelled.tokens >= 3) {
      during = await stats();
      abort.abort();
    }
  }
} catch (error) {
  cancelled.code = Code[ConnectError.from(error).code];
}

// 3. CacheStats until the cancelled sequence has left its slot (the server ends it within a
//    scheduler tick of seeing the cancellation).
let after = await stats();
const gone = (s) => !(s.slots ?? []).some((slot) => slot.requestId === "node-cancel");
for (let i = 0; i < 100 && !(gone(after) && (after.activeSequences ?? 0) === 0); i++) {
  await new Promise((resolve) => setTimeout(resolve, 50));
  after = await stats();
}

console.log(JSON.stringify({ before, during, after, streamed, cancelled }));
