// A Node.js client of asyncinfer's JobService, built only from protos/ (no generated code):
// @grpc/proto-loader reads protos/asyncinfer/v1/job_service.proto at run time and @grpc/grpc-js
// makes the calls. It submits a demo job (y = 2x + 1), watches it to a terminal state, reads it
// back with GetJob and prints one JSON object on stdout. Progress goes to stderr, one JSON object
// per line, so a test can act when the job is QUEUED.
//
//   node tests/node/client.mjs HOST:PORT ['[[1,2,3,4]]']
//
// ASYNCINFER_API_KEY, when set, is sent as `authorization: Bearer <key>`. Exit status: 0 when the
// job SUCCEEDED, 1 when it ended otherwise, 2 on an RPC error (its code and details on stderr).

import path from "node:path";
import { fileURLToPath } from "node:url";

import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";

const here = path.dirname(fileURLToPath(import.meta.url));
const protos = path.resolve(here, "..", "..", "protos");
const CALL_TIMEOUT_MS = 10_000;
const WATCH_TIMEOUT_MS = 60_000;

// protobufjs bundles google/protobuf's well-known types (timestamp, duration, ...), so protos/
// is the only include directory needed.
const definition = protoLoader.loadSync("asyncinfer/v1/job_service.proto", {
  includeDirs: [protos],
  keepCase: true, // field names exactly as in the .proto (fp32_contents, job_id)
  longs: Number,
  enums: String,
  defaults: true,
  oneofs: true,
});
const { JobService } = grpc.loadPackageDefinition(definition).asyncinfer.v1;

function deadline(ms) {
  return new Date(Date.now() + ms);
}

function report(event) {
  process.stderr.write(`${JSON.stringify(event)}\n`);
}

// The values of an output tensor: the typed contents field for its datatype, or its raw
// little-endian bytes.
const TYPED = {
  FP32: ["fp32_contents", (b) => new Float32Array(b.buffer, b.byteOffset, b.length / 4)],
  FP64: ["fp64_contents", (b) => new Float64Array(b.buffer, b.byteOffset, b.length / 8)],
  INT32: ["int_contents", (b) => new Int32Array(b.buffer, b.byteOffset, b.length / 4)],
  INT64: ["int64_contents", (b) => Array.from(new BigInt64Array(b.buffer, b.byteOffset, b.length / 8), Number)],
};

function tensorValues(tensor) {
  const [field, fromRaw] = TYPED[tensor.datatype] ?? [];
  if (!field) throw new Error(`datatype ${tensor.datatype} is not decoded by this client`);
  const raw = tensor.raw_contents;
  if (raw && raw.length > 0) {
    // Copy: Buffers from a pool may not be aligned for a typed array view.
    return Array.from(fromRaw(Buffer.from(raw)));
  }
  return Array.from(tensor.contents?.[field] ?? []);
}

function outputsOf(job) {
  const outputs = {};
  for (const tensor of job.outputs) {
    outputs[tensor.name] = { datatype: tensor.datatype, shape: tensor.shape.map(Number), data: tensorValues(tensor) };
  }
  return outputs;
}

function unary(client, method, request, metadata) {
  return new Promise((resolve, reject) => {
    client[method](request, metadata, { deadline: deadline(CALL_TIMEOUT_MS) }, (error, response) =>
      error ? reject(error) : resolve(response),
    );
  });
}

function watchToEnd(client, jobId, metadata) {
  return new Promise((resolve, reject) => {
    const states = [];
    let last = null;
    const call = client.WatchJob({ job_id: jobId, after_revision: 0 }, metadata, {
      deadline: deadline(WATCH_TIMEOUT_MS),
    });
    call.on("data", (update) => {
      last = update.job;
      states.push(last.state);
      report({ event: "update", job_id: jobId, state: last.state, revision: Number(last.revision) });
    });
    call.on("error", reject);
    call.on("end", () => resolve({ states, last }));
  });
}

// A label watch (WatchJobs): resolves with its headers, which the gateway sends once it listens
// (asyncinfer-watch-ready); `firstChange` then resolves with the first change of the job named.
function openLabelWatch(client, labels, metadata) {
  const call = client.WatchJobs({ labels }, metadata, { deadline: deadline(WATCH_TIMEOUT_MS) });
  const changes = [];
  let wanted = null;
  call.on("data", (response) => {
    changes.push(...response.changes);
    wanted?.();
  });
  const ended = new Promise((_, reject) => call.on("error", reject));
  ended.catch(() => {}); // a cancel (ours, at the end) ends it CANCELLED
  const firstChange = (jobId) =>
    Promise.race([
      ended,
      new Promise((resolve) => {
        wanted = () => {
          const change = changes.find((c) => c.job_id === jobId);
          if (change) resolve(change);
        };
        wanted();
      }),
    ]);
  const headers = Promise.race([ended, new Promise((resolve) => call.on("metadata", resolve))]);
  return { call, headers, firstChange };
}

async function main() {
  const [address, inputsJson] = process.argv.slice(2);
  if (!address) {
    process.stderr.write("usage: node client.mjs HOST:PORT ['[[1,2,3,4]]']\n");
    process.exit(64);
  }
  const rows = JSON.parse(inputsJson ?? "[[1, 2, 3, 4], [0, 0, 0, -1]]");
  const metadata = new grpc.Metadata();
  if (process.env.ASYNCINFER_API_KEY) metadata.add("authorization", `Bearer ${process.env.ASYNCINFER_API_KEY}`);

  const client = new JobService(address, grpc.credentials.createInsecure());
  const labels = { client: "node" };
  const labelWatch = openLabelWatch(client, labels, metadata);
  try {
    const headers = await labelWatch.headers;
    report({ event: "label_watch_ready", header: headers.get("asyncinfer-watch-ready") });
    const submitted = await unary(
      client,
      "SubmitJob",
      {
        model_name: "demo",
        priority: "PRIORITY_NORMAL",
        labels,
        inputs: [
          {
            name: "x",
            datatype: "FP32",
            shape: [rows.length, rows[0].length],
            contents: { fp32_contents: rows.flat() },
          },
        ],
      },
      metadata,
    );
    const jobId = submitted.job.job_id;
    report({ event: "submitted", job_id: jobId, state: submitted.job.state });
    const labelled = await labelWatch.firstChange(jobId);
    report({ event: "label_watch_first", job_id: jobId, state: labelled.job.state });
    labelWatch.call.cancel();

    const { states, last } = await watchToEnd(client, jobId, metadata);
    const { job } = await unary(client, "GetJob", { job_id: jobId }, metadata);
    process.stdout.write(
      `${JSON.stringify({
        job_id: jobId,
        states,
        state: job.state,
        watched_state: last?.state ?? null,
        attempt: job.attempt,
        outputs: outputsOf(job),
      })}\n`,
    );
    process.exitCode = job.state === "JOB_STATE_SUCCEEDED" ? 0 : 1;
  } catch (error) {
    report({ event: "error", code: error.code, code_name: grpc.status[error.code], details: error.details });
    process.exitCode = 2;
  } finally {
    client.close();
  }
}

await main();
