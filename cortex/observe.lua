-- Cortex's response observation, run by Envoy on every response (docs/observability.md).
--
-- Per request it records, as dynamic metadata in namespace "cortex.observed" (Envoy's access log carries it to
-- `cortex observe`): the wall-clock time (µs since the epoch) of the first and the last response body chunk,
-- how many chunks and bytes went to the client, and the engine's final `usage` numbers. It never buffers a
-- response: each chunk is looked at and passed on. Only when extproc asked the engine for usage on the
-- client's behalf (metadata cortex.usage_injected) does it cut that usage event out of the stream; it then
-- holds back an unfinished server-sent event only while it may still be that event (no choice in it yet).
--
-- A usage object is found by its key (`"usage":{`, or SGLang's `"meta_info":{`): it cannot occur inside a JSON
-- string (a quote there is escaped), so a match is the real key. The object is captured across chunks (bounded) until its braces
-- balance; only keys and numbers are inside, so counting braces is exact.

local NS = "cortex.observed"
local MAX_USAGE = 4096        -- longest usage object captured
local MAX_PENDING = 65536     -- strip mode: the most an unfinished event may hold back before it passes as is
local USAGE_KEY = '"usage"%s*:%s*{'
local META_KEY = '"meta_info"%s*:%s*{'  -- SGLang's /generate reports its usage there
local A_CHOICE = '"choices"%s*:%s*%[%s*{'
local NO_CHOICES = '"choices"%s*:%s*%[%s*%]'
local EVENT_END = "\n\r?\n"
local EVERY = 16              -- running figures are written every this many chunks, and at the end

local function now_us(h)
  return tonumber(h:timestampString(EnvoyTimestampResolution.MICROSECOND))
end

-- The index closing the object that opens at s[1], or nil while it is incomplete.
local function object_end(s)
  local depth = 0
  for i = 1, #s do
    local c = s:byte(i)
    if c == 123 then
      depth = depth + 1
    elseif c == 125 then
      depth = depth - 1
      if depth == 0 then return i end
    end
  end
  return nil
end

-- Every API's usage in one form: prompt tokens (all of them, cached included), completion tokens, cached tokens.
-- OpenAI chat/completions and SGLang's meta_info say so directly; the Responses API says input/output tokens
-- (input includes the cached ones, in input_tokens_details.cached_tokens); Anthropic's Messages API counts the
-- cache reads and writes apart from input_tokens.
local function record_usage(md, obj)  -- md: a fresh dynamicMetadata() handle
  local p = tonumber(obj:match('"prompt_tokens"%s*:%s*(%d+)'))
  local c = tonumber(obj:match('"completion_tokens"%s*:%s*(%d+)'))
  local k = tonumber(obj:match('"cached_tokens"%s*:%s*(%d+)'))
  local input = tonumber(obj:match('"input_tokens"%s*:%s*(%d+)'))
  local read = tonumber(obj:match('"cache_read_input_tokens"%s*:%s*(%d+)'))
  if not p and input then
    p = input + (read or 0) + (tonumber(obj:match('"cache_creation_input_tokens"%s*:%s*(%d+)')) or 0)
  end
  c = c or tonumber(obj:match('"output_tokens"%s*:%s*(%d+)'))
  k = k or read
  if p then md:set(NS, "prompt_tokens", p) end
  if c then md:set(NS, "completion_tokens", c) end
  if k then md:set(NS, "cached_tokens", k) end
end

-- Usage finder: feed(text) with consecutive pieces of the body; records every complete usage object.
-- `meta` returns the stream's dynamic metadata: Envoy's handles do not survive a yield, so one is asked for
-- each time it is written.
local function usage_finder(meta)
  local carry, cap = "", nil
  return function(data)
    local s
    if cap then
      s = cap .. data
    else
      s = carry .. data
    end
    carry = s:sub(-24)  -- a key split across chunks is found with the next one
    while true do
      if not cap then
        local _, b = s:find(USAGE_KEY)
        local _, m = s:find(META_KEY)
        if m and (not b or m < b) then b = m end
        if not b then return end
        s = s:sub(b)  -- starts at the object's "{"
      end
      local e = object_end(s)
      if not e then
        cap = (#s <= MAX_USAGE) and s or nil
        return
      end
      record_usage(meta(), s:sub(1, e))
      cap = nil
      s = s:sub(e + 1)
      carry = s:sub(-24)
    end
  end
end

-- Strip mode: pass every server-sent event except those that carry a usage object and no choices.
local function usage_stripper()
  local pending, passing, tail = "", false, ""
  return function(data)
    local out = {}
    local s = data
    if passing then
      -- The current event's beginning already went out: pass it to its end.
      local _, e = (tail .. s):find(EVENT_END)
      if not e then
        tail = (tail .. s):sub(-3)
        return s
      end
      e = e - #tail
      out[#out + 1] = s:sub(1, e)
      s = s:sub(e + 1)
      passing, tail = false, ""
    end
    s = pending .. s
    pending = ""
    local from = 1
    while true do
      local _, e = s:find(EVENT_END, from)
      if not e then break end
      local event = s:sub(from, e)
      if not (event:find(USAGE_KEY) and event:find(NO_CHOICES)) then out[#out + 1] = event end
      from = e + 1
    end
    local rest = s:sub(from)
    if #rest > 0 then
      if rest:find(A_CHOICE) or #rest > MAX_PENDING then
        out[#out + 1] = rest
        passing, tail = true, rest:sub(-3)
      else
        pending = rest  -- may still be the usage event: wait for its end
      end
    end
    return table.concat(out)
  end
end

function envoy_on_response(h)
  local function meta() return h:streamInfo():dynamicMetadata() end
  local cortex = meta():get("cortex")
  local strip = nil
  local sse = (h:headers():get("content-type") or ""):find("text/event-stream", 1, true)
  if cortex ~= nil and cortex["usage_injected"] == true and sse then strip = usage_stripper() end
  local find_usage = usage_finder(meta)
  local chunks, bytes, first = 0, 0, false
  -- The running figures are written every EVERY chunks and once at the end, not per chunk (each write is a
  -- protobuf update); a stream cut short keeps those of its last multiple of EVERY chunks.
  local function note(md)
    md:set(NS, "last_us", now_us(h))
    md:set(NS, "chunks", chunks)
    md:set(NS, "bytes", bytes)
  end
  for chunk in h:bodyChunks() do
    local n = chunk:length()
    if n > 0 then
      if not first then
        first = true
        meta():set(NS, "first_us", now_us(h))
      end
      local data = chunk:getBytes(0, n)
      find_usage(data)
      if strip then
        local out = strip(data)
        if #out ~= n then chunk:setBytes(out) end
        n = #out
      end
      chunks = chunks + 1
      bytes = bytes + n
      if chunks % EVERY == 0 then note(meta()) end
    end
  end
  if first then note(meta()) end
end
