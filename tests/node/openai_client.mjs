// The official `openai` npm client, unchanged, against knapserve's HTTP front
// door. Run by tests/tools/knapserve_cli_test.cc
// (OfficialOpenAiClientDrivesTheHttpFrontDoor):
//
//   node tests/node/openai_client.mjs BASE_URL MODEL
//
// Every check is a node:assert; the first that fails exits non-zero with its
// message. On success it prints one JSON object with what the C++ test
// compares against gRPC and local generation (the greedy ids).
import assert from 'node:assert/strict';
import OpenAI from 'openai';

const [baseURL, model] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: 'unused', maxRetries: 0 });
const prompt = 'Once upon a time';
const report = {};

// Models.
const models = await client.models.list();
assert.ok(models.data.some((m) => m.id === model), 'the model is listed');

// Non-streamed greedy completion; extra body fields (ignore_eos, knapserve)
// pass through the client as they are.
const whole = await client.completions.create({
  model, prompt, max_tokens: 40, temperature: 0, ignore_eos: true,
});
assert.equal(whole.object, 'text_completion');
assert.equal(whole.choices.length, 1);
assert.equal(whole.choices[0].finish_reason, 'length');
assert.equal(whole.usage.completion_tokens, 40);
assert.equal(whole.usage.total_tokens,
             whole.usage.prompt_tokens + whole.usage.completion_tokens);
report.greedy_text = whole.choices[0].text;
report.greedy_ids = whole.knapserve.output_token_ids;

// Streamed: the same text, a usage chunk when asked, chunks in order.
const stream = await client.completions.create({
  model, prompt, max_tokens: 40, temperature: 0, ignore_eos: true,
  stream: true, stream_options: { include_usage: true },
});
let streamed = '';
let chunks = 0;
let usage = null;
let finish = null;
for await (const chunk of stream) {
  if (chunk.usage) usage = chunk.usage;
  for (const choice of chunk.choices) {
    streamed += choice.text;
    if (choice.finish_reason) finish = choice.finish_reason;
    chunks++;
  }
}
assert.equal(streamed, report.greedy_text, 'streamed text = whole text');
assert.ok(chunks > 1, 'more than one chunk');
assert.equal(finish, 'length');
assert.ok(usage, 'a usage chunk');
assert.equal(usage.completion_tokens, 40);
report.stream_chunks = chunks;

// Speculation per request through the extension object: lossless, and the
// acceptance stats come back beside the choices.
const spec = await client.completions.create({
  model, prompt, max_tokens: 40, temperature: 0, ignore_eos: true,
  knapserve: { spec: 'knapspec', max_draft: 6 },
});
assert.equal(spec.choices[0].text, report.greedy_text, 'knapspec is lossless');
assert.equal(spec.knapserve.spec, 'knapspec');
assert.equal(typeof spec.knapserve.acceptance_rate, 'number');
report.knapspec_mean_accepted_length = spec.knapserve.mean_accepted_length;

// Stop strings: the output ends before the first match.
const stopWord = report.greedy_text.trim().split(/\s+/)[2];
const stopped = await client.completions.create({
  model, prompt, max_tokens: 40, temperature: 0, stop: [' ' + stopWord, 'zzz'],
});
assert.equal(stopped.choices[0].finish_reason, 'stop');
assert.ok(!stopped.choices[0].text.includes(' ' + stopWord));
assert.ok(report.greedy_text.startsWith(stopped.choices[0].text));
report.stopped_text = stopped.choices[0].text;

// Seeds: the same seed gives the same sample.
const sample = (seed) => client.completions.create({
  model, prompt, max_tokens: 24, temperature: 0.9, top_p: 0.95, seed,
});
const [a, b] = await Promise.all([sample(42), sample(42)]);
assert.equal(a.choices[0].text, b.choices[0].text, 'same seed, same sample');
report.seeded_text = a.choices[0].text;
// ... whatever the speculation mode.
const speculated = await client.completions.create({
  model, prompt, max_tokens: 24, temperature: 0.9, top_p: 0.95, seed: 42,
  knapserve: { spec: 'static', static_mask: 'a1,m3', max_draft: 3 },
});
assert.equal(speculated.choices[0].text, a.choices[0].text,
             'a seed means the same text with speculation');

// n choices, streamed: each chunk says its choice; best_of keeps the
// likeliest candidate.
const several = await client.completions.create({
  model, prompt, max_tokens: 10, temperature: 1, seed: 7, n: 3,
  ignore_eos: true, stream: true,
});
const texts = ['', '', ''];
let ends = 0;
for await (const chunk of several) {
  for (const choice of chunk.choices) {
    texts[choice.index] += choice.text;
    if (choice.finish_reason) ends += 1;
  }
}
assert.equal(ends, 3, 'each choice finishes');
assert.ok(new Set(texts).size > 1, 'the choices sample their own streams');
const picked = await client.completions.create({
  model, prompt, max_tokens: 10, temperature: 1, seed: 7, n: 1, best_of: 3,
  ignore_eos: true,
});
assert.equal(picked.choices.length, 1);
assert.ok(texts.includes(picked.choices[0].text), 'best_of picks a candidate');
report.choice_texts = texts;

// Logits processors. A +100 bias on one token makes greedy output that
// token over and over (ignored, the bias would leave the greedy text).
const biasToken = 300;
const biased = await client.completions.create({
  model, prompt, max_tokens: 8, temperature: 0, ignore_eos: true,
  logit_bias: { [String(biasToken)]: 100 },
});
assert.deepEqual(biased.knapserve.output_token_ids, Array(8).fill(biasToken),
                 'logit_bias +100 wins every position');
// Penalties change greedy output; the C++ test compares these ids with
// `knapserve generate --presence-penalty 0.5 --frequency-penalty 1`.
const penalized = await client.completions.create({
  model, prompt, max_tokens: 40, temperature: 0, ignore_eos: true,
  presence_penalty: 0.5, frequency_penalty: 1.0,
});
assert.notDeepEqual(penalized.knapserve.output_token_ids, report.greedy_ids,
                    'the penalties change the greedy output');
report.penalized_ids = penalized.knapserve.output_token_ids;
// vLLM's extensions pass through the client as extra body fields: a
// banned id never appears, and no stop id ends the output before
// min_tokens.
const bannedId = report.greedy_ids[1];
const extras = await client.completions.create({
  model, prompt, max_tokens: 16, temperature: 0.8, seed: 3, top_k: 20,
  min_p: 0.05, repetition_penalty: 1.2, min_tokens: 8,
  stop_token_ids: [report.greedy_ids[0]], bad_words: [[bannedId]],
});
const extraIds = extras.knapserve.output_token_ids;
assert.ok(!extraIds.includes(bannedId), 'bad_words bans the id');
assert.ok(extraIds.length >= 8, 'min_tokens holds the stop ids back');
// Out of range: a 400 naming the field.
await assert.rejects(
  client.completions.create({ model, prompt, max_tokens: 4, presence_penalty: 3 }),
  (e) => e instanceof OpenAI.BadRequestError && e.error?.param === 'presence_penalty');
await assert.rejects(
  client.completions.create({
    model, prompt, max_tokens: 4, logit_bias: { '999999': 1 },
  }),
  (e) => e instanceof OpenAI.BadRequestError && e.error?.param === 'logit_bias');

// Chat, whole and streamed, with logprobs.
const messages = [
  { role: 'system', content: 'You tell short stories.' },
  { role: 'user', content: 'Tell me about a cat.' },
];
const chat = await client.chat.completions.create({
  model, messages, max_completion_tokens: 20, temperature: 0,
  logprobs: true, top_logprobs: 3, ignore_eos: true,
});
assert.equal(chat.object, 'chat.completion');
assert.equal(chat.choices[0].message.role, 'assistant');
assert.equal(chat.choices[0].logprobs.content.length, 20);
for (const t of chat.choices[0].logprobs.content) {
  assert.ok(t.logprob <= 0, 'a log-probability');
  // Greedy: the chosen token is the most likely of the three alternatives.
  assert.equal(t.top_logprobs.length, 3);
  assert.ok(Math.abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4,
            'greedy picks the top alternative');
  assert.ok(t.top_logprobs[1].logprob <= t.top_logprobs[0].logprob);
}
// Completions take the count as logprobs (the legacy shape).
const legacy = await client.completions.create({
  model, prompt, max_tokens: 5, temperature: 0, logprobs: 2, ignore_eos: true,
});
assert.equal(legacy.choices[0].logprobs.top_logprobs.length, 5);
assert.equal(legacy.choices[0].logprobs.token_logprobs.length, 5);
// echo: the prompt before the completion, its first token's logprob null.
const echoed = await client.completions.create({
  model, prompt, max_tokens: 5, temperature: 0, logprobs: 0, echo: true,
  ignore_eos: true,
});
assert.ok(echoed.choices[0].text.startsWith(prompt), 'the prompt is echoed');
assert.equal(echoed.choices[0].text, prompt + legacy.choices[0].text);
assert.equal(echoed.choices[0].logprobs.token_logprobs[0], null);
assert.ok(echoed.choices[0].logprobs.token_logprobs[1] <= 0);
await assert.rejects(
  client.chat.completions.create({
    model, messages, max_completion_tokens: 4, logprobs: true,
    top_logprobs: 21,
  }),
  (e) => e instanceof OpenAI.BadRequestError &&
         e.error?.param === 'top_logprobs');
const chatStream = await client.chat.completions.create({
  model, messages, max_completion_tokens: 20, temperature: 0,
  ignore_eos: true, stream: true,
});
let chatText = '';
let role = null;
for await (const chunk of chatStream) {
  for (const choice of chunk.choices) {
    if (choice.delta.role) role = choice.delta.role;
    chatText += choice.delta.content ?? '';
  }
}
assert.equal(role, 'assistant');
assert.equal(chatText, chat.choices[0].message.content);
report.chat_text = chatText;

// Through chat, streamed: a -100 bias on the unbiased chat's first token
// (with a frequency penalty beside it) keeps that token out of the output.
const chatBan = chat.knapserve.output_token_ids[0];
const banned = await client.chat.completions.create({
  model, messages, max_completion_tokens: 20, temperature: 0,
  ignore_eos: true, stream: true,
  logit_bias: { [String(chatBan)]: -100 }, frequency_penalty: 0.5,
});
const bannedIds = [];
for await (const chunk of banned) {
  bannedIds.push(...(chunk.knapserve?.token_ids ?? []));
}
assert.equal(bannedIds.length, 20);
assert.ok(!bannedIds.includes(chatBan), 'a -100 bias bans the token');

// Errors arrive as the client's typed errors with OpenAI's codes.
await assert.rejects(
  client.completions.create({ model, prompt, max_tokens: 4, n: 17 }),
  (e) => e instanceof OpenAI.BadRequestError && e.status === 400 &&
         e.error?.param === 'n');
await assert.rejects(
  client.completions.create({ model: 'no-such-model', prompt, max_tokens: 4 }),
  (e) => e instanceof OpenAI.NotFoundError && e.status === 404);
await assert.rejects(
  client.chat.completions.create({
    model, messages, max_completion_tokens: 4, temperature: -1,
  }),
  (e) => e instanceof OpenAI.BadRequestError && /temperature/.test(e.message));

console.log(JSON.stringify(report));
