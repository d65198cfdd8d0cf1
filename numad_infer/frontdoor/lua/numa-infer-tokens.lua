-- numa-infer: an answer's token counts, as the engine reported them
-- (numad_infer/frontdoor/token_count.py), run by numa-infer.lua.
local numa = ...
local FILTER = numa.text("tokens.filter")
local TAIL = numa.number("tokens.tail")  -- bytes read again with the next chunk
local PROMPT_VAR, COMPLETION_VAR = numa.text("tokens.prompt_var"), numa.text("tokens.completion_var")

local NumaTokens = {}
NumaTokens.id = "numa-infer token counts"
NumaTokens.flags = filter.FLT_CFG_FL_HTX
NumaTokens.__index = NumaTokens
local TOKEN_KEYS = {"prompt_tokens", "completion_tokens", "prompt_n", "cache_n", "predicted_n"}

function NumaTokens.new()  -- called as NumaTokens:new(); the class is not needed
  return setmetatable({tail = "", seen = {}}, NumaTokens)
end

function NumaTokens:start_analyze(_, chn)
  if chn:is_resp() then filter.register_data_filter(self, chn) end
end

function NumaTokens:http_payload(txn, msg)
  local data = msg:body(0, -1)
  if data == nil or #data == 0 then return end
  local text = self.tail .. data
  self.tail = string.sub(text, -TAIL)
  local seen = self.seen
  for _, key in ipairs(TOKEN_KEYS) do
    -- Anchored, and only where the key is: an unanchored `.*` is tried again from every
    -- position of a chunk without it (quadratic: a 16 KiB chunk held HAProxy's thread past
    -- its watchdog's 3 s, which killed it).
    if string.find(text, '"' .. key .. '"', 1, true) then
      local value = string.match(text, '^.*"' .. key .. '"%s*:%s*(%d+)')
      if value then seen[key] = tonumber(value) end
    end
  end
  local prompt, completion = seen.prompt_tokens, seen.completion_tokens
  if prompt == nil and seen.prompt_n ~= nil then prompt = seen.prompt_n + (seen.cache_n or 0) end
  if completion == nil then completion = seen.predicted_n end
  if prompt ~= nil then txn:set_var(PROMPT_VAR, prompt) end
  if completion ~= nil then txn:set_var(COMPLETION_VAR, completion) end
end

core.register_filter(FILTER, NumaTokens, function(flt) return flt end)
