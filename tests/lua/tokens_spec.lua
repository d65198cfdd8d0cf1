-- numa-infer-tokens.lua: an answer's token counts, read as it passes, sent whole or
-- streamed (numad_infer/frontdoor/token_count.py; end to end: tests/frontdoor/test_tenants.py).
local fake = require("tests.lua.fake_haproxy")

describe("the token filter", function()
  local h

  before_each(function()
    h = fake.load({"numa-infer-tokens.lua"})
    h:start()
  end)

  after_each(function()
    h:close()
  end)

  local function channel(is_response)
    return {is_resp = function() return is_response end}
  end

  -- One answer through the filter as HAProxy 2.6 runs it: a filter made per stream
  -- (`filter lua.numa_tokens`), analyzing both channels, then each chunk of the answer's
  -- body (HAProxy forwards it when http_payload returns nothing).
  local function answer(chunks)
    local registered = h.filters.numa_tokens
    local class = registered.class
    local flt = registered.fn(class:new(), {})
    local txn = h:txn("m")
    local before = #h.filter.registered
    flt:start_analyze(txn, channel(false))
    assert.are.equal(before, #h.filter.registered)  -- the request is not read
    local response = channel(true)
    flt:start_analyze(txn, response)
    assert.are.same({flt, response}, h.filter.registered[#h.filter.registered])
    for _, chunk in ipairs(chunks) do
      assert.is_nil(flt:http_payload(txn, {body = function() return chunk end}))
    end
    return txn:get_var("txn.prompt_tokens"), txn:get_var("txn.completion_tokens")
  end

  it("declares an HTX filter", function()
    assert.are.equal(h.filter.FLT_CFG_FL_HTX, h.filters.numa_tokens.class.flags)
  end)

  it("reads OpenAI's usage from an answer sent whole", function()
    local prompt, completion = answer({
      '{"id":"x","choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens": 12,"completion_tokens":34}}'})
    assert.are.equal(12, prompt)
    assert.are.equal(34, completion)
  end)

  it("reads llama-server's timings from a stream's last event: prompt read + cached, predicted", function()
    local prompt, completion = answer({
      'data: {"choices":[{"delta":{"content":"a"}}]}\n\n',
      'data: {"choices":[{"delta":{"content":"b"}}]}\n\n',
      'data: {"choices":[],"timings":{"cache_n":5,"prompt_n":7,"predicted_n":9}}\n\ndata: [DONE]\n\n'})
    assert.are.equal(12, prompt)
    assert.are.equal(9, completion)
  end)

  it("prefers usage to timings where the stream has both", function()
    local prompt, completion = answer({
      'data: {"choices":[],"usage":{"prompt_tokens":20,"completion_tokens":3},',
      '"timings":{"prompt_n":1,"cache_n":1,"predicted_n":1}}\n\n'})
    assert.are.equal(20, prompt)
    assert.are.equal(3, completion)
  end)

  it("reads a count split between two chunks whole", function()
    local prompt, completion = answer({'{"usage":{"prompt_tokens":1', '23,"completion_tokens":4', '56}}'})
    assert.are.equal(123, prompt)
    assert.are.equal(456, completion)
  end)

  it("never reads the model's own text, where JSON escapes the quotes", function()
    local prompt, completion = answer({'data: {"choices":[{"delta":{"content":"\\"prompt_tokens\\": 99"}}]}\n\n'})
    assert.is_nil(prompt)
    assert.is_nil(completion)
  end)

  it("counts nothing for an answer with neither, nor for an empty chunk", function()
    local prompt, completion = answer({"", 'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'})
    assert.is_nil(prompt)
    assert.is_nil(completion)
  end)

  it("reads a long chunk without a count in linear time", function()
    local started = os.clock()
    local prompt = answer({string.rep('{"content":"abc"}', 20000), '"usage":{"prompt_tokens":8}'})
    assert.are.equal(8, prompt)
    assert.is_true(os.clock() - started < 1)
  end)
end)
