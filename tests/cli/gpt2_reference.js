// The reference GPT-2 encoder for tokenizer_test.sh: gpt-3-encoder's encode()
// on stdin (read as UTF-8), ids printed space-separated on one line.
//
//   node gpt2_reference.js PACKAGE_DIR [--fixed] < text.txt
//
// --fixed repairs one bug of gpt-3-encoder before loading it: it keys its
// merge table by String(pair), i.e. "a,b", so the pair ('",', '"') finds the
// rank of the merge ('"', ',"') although it is not a merge (11 such
// collisions in vocab.bpe), and merges where OpenAI's encoder.py does not.
// Joining pairs with a space instead (tokens never contain one: the space
// byte is spelled 'Ġ') makes its table exactly encoder.py's.
'use strict';
const fs = require('fs');
const path = require('path');

const [dir, flag] = process.argv.slice(2);
if (!dir || (flag !== undefined && flag !== '--fixed')) {
  console.error('usage: node gpt2_reference.js PACKAGE_DIR [--fixed] < text');
  process.exit(2);
}
if (flag === '--fixed') {
  // Only this process, which does nothing but encode, sees the change.
  Array.prototype.toString = function () { return this.join(' '); };
}
const { encode } = require(path.resolve(dir));

// encode() concatenates its output array once per word (quadratic), so long
// texts go in pieces cut where a word ends and whitespace starts: GPT-2's
// regex neither matches nor looks across such a point (the rule of
// next_safe_cut in runtime/tokenizer.h), so the ids are those of the whole.
const text = fs.readFileSync(0, 'utf8');
const kPiece = 4096;
const out = [];
for (let begin = 0; begin < text.length;) {
  let cut = Math.min(text.length, begin + kPiece);
  while (cut < text.length) {
    const before = text.charCodeAt(cut - 1), at = text[cut];
    if ((at === ' ' || at === '\n') && before > 0x20 && before < 0x7f) break;
    ++cut;
  }
  for (const id of encode(text.slice(begin, cut))) out.push(id);
  begin = cut;
}
process.stdout.write(out.join(' ') + '\n');
