-- wrk script: POST JSON webhooks whose event IDs are unique per run, per thread and per request.
--
--   wrk ... -s bench/unique_ids.lua URL -- RUN_ID MODE BODY_BYTES SEEDS [SIGNATURES]
--
-- MODE "unique": every request carries a new ID. MODE "dup50": half the requests (at random)
-- reuse one of SEEDS IDs "seed-1" .. "seed-SEEDS" that the benchmark committed beforehand.
-- MODE "dup100": every request reuses one of them. MODE "stripe": unique IDs as "unique", each
-- request signed for a Stripe route: line N of the file SIGNATURES.THREAD is the
-- Stripe-Signature of the thread's request N, which bench/loads.py computed beforehand for the
-- body this script builds (Lua has no HMAC); its IDs' 8 hex digits come from N, not at random.
-- A unique ID starts with 8 random hex digits, so that claims land all over the table's index
-- as real providers' IDs do, then RUN_ID-THREAD-COUNTER, which makes it unique. The body is
-- {"id":"…","pad":"xxx…"} padded to about BODY_BYTES; the ID comes first (bench/upstream.py
-- reads it from there). done() prints one line "BENCH-JSON {…}" for bench/run.py.

local threads = {}

function setup(thread)
   table.insert(threads, thread)
   thread:set("tid", #threads)
end

function init(args)
   run_id = args[1] or "run"
   mode = args[2] or "unique"
   local size = tonumber(args[3] or "1024")
   seeds = tonumber(args[4] or "0")
   generated = 0
   uniques = 0
   -- wrk calls request() once in the first thread, before the run, to check what it returns
   -- (script_verify_request); that request is never sent, so it is not counted.
   verifying = tid == 1
   math.randomseed(os.time() * 1000 + tid * 7919)
   -- {"id":"<8 hex>-<run>-<thread>-<10 digits>","pad":"…"}: 22 bytes of JSON around the two.
   local id_length = 8 + 1 + #run_id + 1 + #tostring(tid) + 1 + 10
   pad = string.rep("x", math.max(0, size - 22 - id_length))
   headers = { ["Content-Type"] = "application/json" }
   signatures = {}
   if mode == "stripe" then
      for line in io.lines(args[5] .. "." .. tid) do
         table.insert(signatures, line)
      end
   end
end

function request()
   local id
   if verifying then
      verifying = false
      return wrk.format("POST", nil, headers, '{"id":"never-sent","pad":"' .. pad .. '"}')
   end
   generated = generated + 1
   if (mode == "dup100" or (mode == "dup50" and math.random() < 0.5)) and seeds > 0 then
      id = "seed-" .. math.random(1, seeds)
   elseif mode == "stripe" then
      uniques = uniques + 1
      id = string.format("%08x-%s-%d-%010d", (uniques * 2654435761) % 2147483648, run_id, tid,
                         uniques)
      headers["Stripe-Signature"] = signatures[uniques] or "t=0,v1=exhausted"
   else
      uniques = uniques + 1
      id = string.format("%08x-%s-%d-%010d", math.random(0, 0x7fffffff), run_id, tid, uniques)
   end
   return wrk.format("POST", nil, headers, '{"id":"' .. id .. '","pad":"' .. pad .. '"}')
end

function done(summary, latency, requests)
   local sent, unique = 0, 0
   for _, thread in ipairs(threads) do
      sent = sent + thread:get("generated")
      unique = unique + thread:get("uniques")
   end
   local e = summary.errors
   io.write(string.format(
      'BENCH-JSON {"requests":%d,"duration_us":%d,"bytes":%d,'
         .. '"errors":{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d},'
         .. '"latency_us":{"p50":%d,"p90":%d,"p99":%d,"mean":%.1f,"max":%d},'
         .. '"sent":%d,"uniques":%d}\n',
      summary.requests, summary.duration, summary.bytes,
      e.connect, e.read, e.write, e.status, e.timeout,
      latency:percentile(50), latency:percentile(90), latency:percentile(99),
      latency.mean, latency.max, sent, unique))
end
