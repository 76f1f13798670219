-- Cortex's decision caller (extproc.transport: http; docs/architecture.md, "The decision over HTTP").
--
-- For each request: the buffered body and the headers go to an extproc process over HTTP (one exchange on a kept
-- connection), and its answer is acted on as Envoy's ext_proc filter would act on the same decision: request
-- headers set and removed, the body replaced, a refusal sent, the facts written as dynamic metadata for the
-- observation, the route cache cleared so the pool header routes the request. The protocol is
-- extproc/http_exchange.py's. The process that decided is recorded (metadata cortex.decide): it holds the request
-- until its end, which this filter posts to it, and Envoy's access log sends it too. The claim headers for the
-- client are kept in metadata and put on the response; when Envoy retried on another worker (the route puts the
-- served worker's address and id on the response), the retry's claims (no hit) are put instead.
--
-- CORTEX, the settings, is prepended by cortex/envoy_config.py (decide_filter).

local ACT, STATUS, SET, REMOVE, BODY, CLIENT, META, CHOSEN, HIDE, RETRIED = "x-cortex-act", "x-cortex-status",
  "x-cortex-set-", "x-cortex-remove", "x-cortex-body", "x-cortex-client-", "x-cortex-meta-", "x-cortex-chosen",
  "x-cortex-hide", "x-cortex-retried-"
local OWNER_NS, CLIENT_NS, RETRIED_NS = "cortex.decide", "cortex.client", "cortex.client.retried"

local function starts(s, prefix)
  return s:sub(1, #prefix) == prefix
end

local turn = 0  -- per worker thread: spreads the calls over the processes

-- The answer of the first process that answers (each at most once), and its index; nil when none did.
local function ask(h, headers, body)
  for _ = 1, CORTEX.processes do
    turn = turn % CORTEX.processes + 1
    local ok, answer, payload = pcall(h.httpCall, h, CORTEX.cluster_prefix .. (turn - 1), headers, body,
                                      CORTEX.timeout_ms)
    if ok and answer[":status"] == "200" and answer[ACT] ~= nil then
      return turn - 1, answer, payload
    end
  end
  return nil
end

local function typed(v)
  local kind, text = v:sub(1, 1), v:sub(2)
  if kind == "n" then return tonumber(text) end
  if kind == "b" then return text == "1" end
  return text
end

function envoy_on_request(h)
  local headers = h:headers()
  local call = {[":method"] = "POST", [":path"] = CORTEX.path, [":authority"] = "cortex-decide"}
  for k, v in pairs(headers) do
    -- (a client's own copies of the three call headers were stripped before this filter: cortex/headers.py)
    if k == ":method" then call[CORTEX.call_method] = v
    elseif k == ":path" then call[CORTEX.call_path] = v
    elseif k == ":authority" then call[CORTEX.call_authority] = v
    elseif not starts(k, ":") and k ~= "content-length" then
      local prev = call[k]
      if prev == nil then call[k] = v
      elseif type(prev) == "table" then prev[#prev + 1] = v
      else call[k] = {prev, v} end
    end
  end
  local body = h:body()
  local bytes = body and body:getBytes(0, body:length()) or ""
  local owner, answer, payload = ask(h, call, bytes)
  if owner == nil then
    if CORTEX.fail_closed then
      local out = {[":status"] = "503", ["content-type"] = "application/json", ["retry-after"] = "1"}
      for _, name in ipairs(CORTEX.dropped_headers) do out[name] = CORTEX.down_reason end
      h:respond(out, CORTEX.down_body)
    end
    return  -- failing open: no pool header, so Envoy's own balancing serves it
  end
  -- Envoy's handles do not survive the call's yield: each is asked for again.
  headers = h:headers()
  local md = h:streamInfo():dynamicMetadata()
  if answer[ACT] ~= "respond" then
    -- A refusal holds nothing; a request sent on is held by that process until its end (its access-log filter).
    md:set(OWNER_NS, "owner", tostring(owner))
    md:set(OWNER_NS, "rid", headers:get("x-request-id") or "")
  end
  for k, v in pairs(answer) do
    if starts(k, META) then md:set(CORTEX.facts_ns, k:sub(#META + 1), typed(v)) end
  end
  if answer[ACT] == "respond" then
    local out = {[":status"] = answer[STATUS] or "500"}
    for k, v in pairs(answer) do
      if starts(k, SET) then out[k:sub(#SET + 1)] = v end
    end
    h:respond(out, payload or "")
    return
  end
  local removed = answer[REMOVE]
  if removed ~= nil then
    for name in removed:gmatch("[^,]+") do headers:remove(name) end
  end
  for k, v in pairs(answer) do
    if starts(k, SET) then headers:replace(k:sub(#SET + 1), v)
    elseif starts(k, CLIENT) then md:set(CLIENT_NS, k:sub(#CLIENT + 1), v)
    elseif starts(k, RETRIED) then md:set(RETRIED_NS, k:sub(#RETRIED + 1), v) end
  end
  if answer[CHOSEN] ~= nil then md:set(CLIENT_NS, ":chosen", answer[CHOSEN]) end
  if answer[HIDE] ~= nil then md:set(CLIENT_NS, ":hide", true) end
  if answer[BODY] == "replace" then h:body():setBytes(payload or "") end
  h:clearRouteCache()
end

-- The request's end goes to the process that holds it once the answer's last byte passed, without waiting for
-- an answer: what it reserved is released at once. A client that leaves mid-answer ends this coroutine before
-- that; Envoy's access log tells the process instead (cortex/envoy_config.py).
function envoy_on_response(h)
  local headers = h:headers()
  local status = headers:get(":status") or "0"
  local served = headers:get(CORTEX.served_header)
  local served_worker = headers:get(CORTEX.served_worker_header)
  if served ~= nil then headers:remove(CORTEX.served_header) end
  if served_worker ~= nil then headers:remove(CORTEX.served_worker_header) end
  local md = h:streamInfo():dynamicMetadata()
  local owned = md:get(OWNER_NS)
  local claims = md:get(CLIENT_NS)
  if claims ~= nil and claims[":hide"] then
    local names = {}
    for k, _ in pairs(headers) do
      -- The dropped reason is no routing fact: every caller gets it (extproc/isolation.py).
      if starts(k, "x-cortex-") and k ~= CORTEX.dropped_headers[1] then names[#names + 1] = k end
    end
    for _, k in ipairs(names) do headers:remove(k) end
  elseif claims ~= nil then
    local chosen = claims[":chosen"]
    if chosen ~= nil and served ~= nil and served ~= chosen then
      claims = md:get(RETRIED_NS) or {}  -- Envoy retried on another worker: no hit is claimed
    end
    for k, v in pairs(claims) do
      if not starts(k, ":") then headers:replace(k, v) end
    end
    -- The worker that served, as its endpoint's metadata names it (a retry's, or one Envoy chose itself).
    if served_worker ~= nil and served_worker ~= "" and (chosen == nil or served ~= chosen) then
      headers:replace(CORTEX.worker_header, served_worker)
    end
  end
  if owned == nil or owned["rid"] == nil then return end
  for _ in h:bodyChunks() do end
  pcall(h.httpCall, h, CORTEX.cluster_prefix .. owned["owner"], {
    [":method"] = "POST", [":path"] = CORTEX.end_path, [":authority"] = "cortex-decide",
    ["x-request-id"] = owned["rid"], [STATUS] = status, [CORTEX.served_header] = served or ""},
    "", 1000, true)
end
